import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    event_to_json_dict,
)
from kvmesh.errors import ProtocolError

hashes = st.one_of(st.integers(min_value=0, max_value=2**64 - 1), st.binary(min_size=1, max_size=32))
media = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "DISK"]))
stored = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, min_size=1, max_size=4),
    parent_block_hash=st.one_of(st.none(), hashes),
    token_ids=st.lists(st.integers(min_value=0, max_value=2**31), max_size=64),
    block_size=st.sampled_from([16, 64]),
    lora_id=st.one_of(st.none(), st.integers(min_value=0, max_value=100)),
    medium=media,
    lora_name=st.one_of(st.none(), st.text(max_size=8)),
    extra_keys=st.one_of(
        st.none(), st.lists(st.one_of(st.none(), st.lists(st.text(max_size=4), max_size=2)), max_size=3)
    ),
    group_idx=st.one_of(st.none(), st.integers(min_value=0, max_value=3)),
)
removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, min_size=1, max_size=4),
    medium=media,
    group_idx=st.one_of(st.none(), st.integers(min_value=0, max_value=3)),
)
events = st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=8)
dp_ranks = st.one_of(st.none(), st.integers(min_value=0, max_value=7))


def to_map_form(batch: KVEventBatch) -> dict:
    out = []
    for ev in batch.events:
        d = {"type": type(ev).__name__}
        d.update({f: getattr(ev, f) for f in ev.__struct_fields__})
        out.append(d)
    return {"ts": batch.ts, "events": out, "data_parallel_rank": batch.data_parallel_rank}


@settings(max_examples=200, deadline=None)
@given(evs=events, dp=dp_ranks, ts=st.floats(min_value=0, max_value=2e9))
def test_array_form_round_trip(evs, dp, ts):
    payload = encode_batch(evs, ts, dp)
    assert decode_batch(payload) == KVEventBatch(ts, evs, dp)


@settings(max_examples=200, deadline=None)
@given(evs=events, dp=dp_ranks, ts=st.floats(min_value=0, max_value=2e9))
def test_map_form_round_trip(evs, dp, ts):
    batch = KVEventBatch(ts, evs, dp)
    payload = msgspec.msgpack.encode(to_map_form(batch))
    assert decode_batch(payload) == batch


def test_encoder_writes_vllm_positional_form():
    ev = BlockStored([7], None, [1, 2], 2, None, "GPU")
    raw = msgspec.msgpack.decode(encode_batch([ev, BlockRemoved([7], "GPU"), AllBlocksCleared()], 1.5, None))
    assert raw[0] == 1.5
    assert raw[1][0][:7] == ["BlockStored", [7], None, [1, 2], 2, None, "GPU"]
    assert raw[1][1][:3] == ["BlockRemoved", [7], "GPU"]
    assert raw[1][2] == ["AllBlocksCleared"]


def test_missing_trailing_fields_and_unknown_extra_fields():
    old = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [5, 6], 2], ["BlockRemoved", [1]]]])
    batch = decode_batch(old)
    assert batch.events == [BlockStored([1], None, [5, 6], 2), BlockRemoved([1])]
    assert batch.data_parallel_rank is None
    newer = msgspec.msgpack.encode(
        [
            2.0,
            [["BlockRemoved", [1], "CPU", 0, "future-field", 3], {"type": "AllBlocksCleared", "why": "x"}],
            0,
        ]
    )
    assert decode_batch(newer) == KVEventBatch(2.0, [BlockRemoved([1], "CPU", 0), AllBlocksCleared()], 0)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode(42),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode(["x", []]),
        msgspec.msgpack.encode([1.0, [["Nope", 1]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", "not-a-list", None, [], 16]]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]]),
        msgspec.msgpack.encode([1.0, [{"no": "type"}]]),
        msgspec.msgpack.encode([1.0, [7]]),
        msgspec.msgpack.encode([True, []]),
        msgspec.msgpack.encode([1.0, [], "rank"]),
    ],
)
def test_malformed_payloads_raise_protocol_error(raw):
    with pytest.raises(ProtocolError):
        decode_batch(raw)


def test_json_form_has_the_documented_keys():
    keys = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "medium"}
    for ev in (BlockStored([b"\x01"], 3, [1], 1), BlockRemoved([1]), AllBlocksCleared()):
        d = event_to_json_dict(ev)
        assert set(d) == keys
    assert event_to_json_dict(BlockStored([b"\x01\xff"], None, [1], 1))["block_hashes"] == ["01ff"]
