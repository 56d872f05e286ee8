"""Store keys and chunk framing of kvmesh's vLLM secondary tier (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.integrations.tier_keys import check_chunk_bytes, chunk_array, offload_store_key, tier_group
from kvmesh.store.codec import ChunkCodec


def test_servers_of_one_model_and_layout_meet_on_the_same_key() -> None:
    key = b"\x01" * 32 + (0).to_bytes(4, "big")
    group = tier_group("Qwen/Qwen3-8B")
    assert offload_store_key(group, key, 4096) == offload_store_key(tier_group("Qwen/Qwen3-8B"), key, 4096)
    assert offload_store_key(group, key, 4096) != offload_store_key(group, key, 8192)  # another layout
    assert offload_store_key(group, key, 4096) != offload_store_key(tier_group("other"), key, 4096)
    other_group = b"\x01" * 32 + (1).to_bytes(4, "big")  # another KV cache group
    assert offload_store_key(group, key, 4096).chunk != offload_store_key(group, other_group, 4096).chunk


def test_a_row_round_trips_the_codec_bit_for_bit() -> None:
    row = np.random.default_rng(0).integers(0, 256, size=4096, dtype=np.uint8)
    key = offload_store_key(tier_group("m"), b"\x02" * 36, row.size)
    codec = ChunkCodec("raw", b"fleet")
    decoded = codec.decode(codec.encode(key, chunk_array(row)), expected=key)
    assert np.ascontiguousarray(decoded.kv).view(np.uint8).reshape(-1).tobytes() == row.tobytes()


@pytest.mark.parametrize("size", [0, 6, 4098])
def test_chunks_not_framed_as_two_halves_of_words_are_refused(size: int) -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        check_chunk_bytes(size)
