"""The RAM tier's recycled encode buffers: same bytes as a fresh encode, never reused under a reader."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.core.types import BlockKey
from kvmesh.errors import CorruptChunkError
from kvmesh.store.backends.memory import MemoryBackend
from kvmesh.store.chunk_buffers import ChunkBuffers
from kvmesh.store.codec import ChunkCodec, float32_to_bf16
from kvmesh.store.keys import StoreKey

GROUP = "00000000000000aa"


def key(i: int) -> StoreKey:
    return StoreKey(GROUP, BlockKey(i.to_bytes(16, "big")))


def kv(seed: int, tokens: int = 64) -> np.ndarray:
    # 2 x 2 x 4 x 64 x 128 bf16: 256 KiB, so the encode copies several blocks
    values = np.random.default_rng(seed).standard_normal((4, 2, 4, tokens, 128), dtype=np.float32)
    return float32_to_bf16(values)


@pytest.mark.parametrize("hmac_key", [None, b"fleet-key"])
def test_encoding_into_a_recycled_buffer_gives_the_same_bytes_as_a_fresh_encode(hmac_key):
    codec = ChunkCodec(hmac_key=hmac_key)
    stale = bytearray(b"\xff") * len(codec.encode(key(1), kv(1)))
    out = codec.encode(key(1), kv(1), into=lambda n: stale if n == len(stale) else bytearray(n))
    assert out is stale
    assert bytes(out) == codec.encode(key(1), kv(1))
    assert np.array_equal(codec.decode(out, expected=key(1)).kv, kv(1))


def test_a_buffer_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="encode buffer"):
        ChunkCodec().encode(key(1), kv(1), into=lambda n: bytearray(n - 1))


def test_a_decoded_chunk_of_a_writable_buffer_is_read_only():
    codec = ChunkCodec()
    buf = codec.encode(key(1), kv(1), into=bytearray)
    assert not codec.decode(buf).kv.flags.writeable


async def test_a_dropped_chunk_is_reused_once_no_reader_holds_it():
    codec = ChunkCodec()
    size = len(codec.encode(key(0), kv(0)))
    tier = MemoryBackend(2 * size)
    first = codec.encode(key(0), kv(0), into=tier.buffers.take)
    first_id = id(first)
    await tier.put_many([(key(0), first)])
    del first
    (view,) = await tier.get_many([key(0)])
    assert isinstance(view, memoryview) and view.readonly
    decoded = codec.decode(view, expected=key(0))
    del view
    await tier.delete_many([key(0)])
    # the reader still holds the chunk's KV: its buffer waits and the next encode gets a new one
    second = codec.encode(key(1), kv(1), into=tier.buffers.take)
    assert id(second) != first_id
    assert np.array_equal(decoded.kv, kv(0))
    del decoded
    # let go: the next encode of that size reuses it
    third = codec.encode(key(2), kv(2), into=tier.buffers.take)
    assert id(third) == first_id and tier.buffers.num_reused == 1
    assert np.array_equal(codec.decode(third, expected=key(2)).kv, kv(2))


async def test_an_evicted_chunk_feeds_the_next_encode_and_the_pool_stays_within_the_budget():
    codec = ChunkCodec()
    size = len(codec.encode(key(0), kv(0)))
    tier = MemoryBackend(2 * size)
    for i in range(6):
        await tier.put_many([(key(i), codec.encode(key(i), kv(i), into=tier.buffers.take))])
        assert tier.num_bytes + tier.buffers.num_bytes <= 3 * size
    assert tier.num_evictions == 4
    assert tier.buffers.num_allocated == 3 and tier.buffers.num_reused == 3
    for i in (4, 5):
        (value,) = await tier.get_many([key(i)])
        assert value is not None
        assert np.array_equal(codec.decode(value, expected=key(i)).kv, kv(i))


async def test_a_recycled_buffer_never_serves_a_stale_chunk_under_its_old_key():
    codec = ChunkCodec()
    size = len(codec.encode(key(0), kv(0)))
    tier = MemoryBackend(size)
    await tier.put_many([(key(0), codec.encode(key(0), kv(0), into=tier.buffers.take))])
    await tier.put_many([(key(1), codec.encode(key(1), kv(1), into=tier.buffers.take))])
    assert await tier.get_many([key(0)]) == [None]
    (value,) = await tier.get_many([key(1)])
    assert value is not None
    with pytest.raises(CorruptChunkError, match="another key"):
        codec.decode(value, expected=key(0))


def test_the_pool_holds_no_more_than_its_room():
    room = [100]
    pool = ChunkBuffers(lambda: room[0])
    assert pool.give(bytearray(60))
    assert not pool.give(bytearray(60))
    room[0] = 0
    assert not pool.give(bytearray(1))
    assert len(pool.take(60)) == 60 and pool.num_bytes == 0
