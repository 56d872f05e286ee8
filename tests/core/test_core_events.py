import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    event_to_json_dict,
    normalize_event,
)
from kvmesh.errors import ProtocolError

hashes = st.one_of(st.integers(min_value=0, max_value=2**64 - 1), st.binary(min_size=1, max_size=32))
media = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "DISK"]))
opt_text = st.one_of(st.none(), st.text(max_size=8))
spec_kinds = st.one_of(
    st.none(),
    st.sampled_from(
        ["full_attention", "sliding_window", "chunked_local_attention", "mamba", "mla_attention"]
    ),
)
stored = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, min_size=1, max_size=4),
    parent_block_hash=st.one_of(st.none(), hashes),
    token_ids=st.lists(st.integers(min_value=0, max_value=2**31), max_size=64),
    block_size=st.sampled_from([16, 64]),
    lora_id=st.one_of(st.none(), st.integers(min_value=0, max_value=100)),
    medium=media,
    lora_name=opt_text,
    extra_keys=st.one_of(
        st.none(), st.lists(st.one_of(st.none(), st.lists(st.text(max_size=4), max_size=2)), max_size=3)
    ),
    group_idx=st.one_of(st.none(), st.integers(min_value=0, max_value=3)),
    kv_cache_spec_kind=spec_kinds,
    kv_cache_spec_sliding_window=st.one_of(st.none(), st.integers(min_value=1, max_value=8192)),
    locality=st.one_of(st.none(), st.sampled_from(["LOCAL", "REMOTE"])),
    ownership=opt_text,
    session_id=opt_text,
)
removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, min_size=1, max_size=4),
    medium=media,
    group_idx=st.one_of(st.none(), st.integers(min_value=0, max_value=3)),
    locality=st.one_of(st.none(), st.sampled_from(["LOCAL", "REMOTE"])),
    ownership=opt_text,
)
events = st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=8)
dp_ranks = st.one_of(st.none(), st.integers(min_value=0, max_value=7))
timestamps = st.floats(min_value=0, max_value=2e9)


def event_map(ev) -> dict:
    d = {"type": type(ev).__name__}
    d.update({f: getattr(ev, f) for f in ev.__struct_fields__})
    return d


def event_array(ev) -> list:
    return [type(ev).__name__, *(getattr(ev, f) for f in ev.__struct_fields__)]


def to_map_batch(batch: KVEventBatch) -> dict:
    return {
        "ts": batch.ts,
        "events": [event_map(ev) for ev in batch.events],
        "data_parallel_rank": batch.data_parallel_rank,
    }


@settings(max_examples=200, deadline=None)
@given(evs=events, dp=dp_ranks, ts=timestamps)
def test_encoder_round_trip(evs, dp, ts):
    payload = encode_batch(evs, ts, dp)
    assert decode_batch(payload) == KVEventBatch(ts, evs, dp)


@settings(max_examples=200, deadline=None)
@given(evs=events, dp=dp_ranks, ts=timestamps)
def test_encoder_writes_maps_with_vllm_required_keys_and_only_set_optional_keys(evs, dp, ts):
    raw = msgspec.msgpack.decode(encode_batch(evs, ts, dp))
    assert raw[0] == ts and raw[2] == dp and len(raw) == 3
    for ev, enc in zip(evs, raw[1], strict=True):
        assert isinstance(enc, dict) and enc["type"] == type(ev).__name__
        required = {
            "BlockStored": 7,  # block_hashes ... lora_name: vLLM's decoder has no default for them
            "BlockRemoved": 2,  # block_hashes, medium
            "AllBlocksCleared": 0,
        }[type(ev).__name__]
        fields = ev.__struct_fields__
        expected = {
            f: getattr(ev, f) for i, f in enumerate(fields) if i < required or getattr(ev, f) is not None
        }
        assert list(enc) == ["type", *expected]  # vLLM's field order
        assert {k: v for k, v in enc.items() if k != "type"} == msgspec.msgpack.decode(
            msgspec.msgpack.encode(expected)
        )


@settings(max_examples=200, deadline=None)
@given(evs=events, dp=dp_ranks, ts=timestamps)
def test_map_events_in_array_batch_round_trip(evs, dp, ts):
    """vLLM >= 0.32 form, written with every key (as a publisher with omit_defaults=False would)."""
    batch = KVEventBatch(ts, evs, dp)
    payload = msgspec.msgpack.encode([ts, [event_map(ev) for ev in evs], dp])
    assert decode_batch(payload) == batch
    # The public structs encode every field too, so a direct encode is also decodable.
    assert decode_batch(msgspec.msgpack.encode(batch)) == batch


@settings(max_examples=200, deadline=None)
@given(evs=events, dp=dp_ranks, ts=timestamps)
def test_map_batch_round_trip(evs, dp, ts):
    batch = KVEventBatch(ts, evs, dp)
    payload = msgspec.msgpack.encode(to_map_batch(batch))
    assert decode_batch(payload) == batch


@settings(max_examples=200, deadline=None)
@given(evs=events, dp=dp_ranks, ts=timestamps, cut=st.integers(min_value=0, max_value=10))
def test_positional_array_form_round_trip(evs, dp, ts, cut):
    """Older vLLM/kvmesh form: ["BlockStored", ...], nil trailing fields possibly left off."""
    arrays = []
    for ev in evs:
        arr = event_array(ev)
        n_required = {"BlockStored": 5, "BlockRemoved": 2, "AllBlocksCleared": 1}[arr[0]]
        keep = max(n_required, len(arr) - cut)
        if all(v is None for v in arr[keep:]):
            arr = arr[:keep]
        arrays.append(arr)
    payload = msgspec.msgpack.encode([ts, arrays, dp])
    assert decode_batch(payload) == KVEventBatch(ts, evs, dp)


@settings(max_examples=100, deadline=None)
@given(evs=st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), min_size=2, max_size=6))
def test_batch_mixing_map_and_array_events(evs):
    mixed = [event_map(ev) if i % 2 else event_array(ev) for i, ev in enumerate(evs)]
    assert decode_batch(msgspec.msgpack.encode([1.0, mixed])).events == evs


def test_encoder_matches_vllm_layout():
    ev = BlockStored([7], None, [1, 2], 2, None, "GPU")
    raw = msgspec.msgpack.decode(encode_batch([ev, BlockRemoved([7]), AllBlocksCleared()], 1.5, None))
    assert raw == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [7],
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [7], "medium": None},
            {"type": "AllBlocksCleared"},
        ],
        None,
    ]
    full = BlockStored([1], 2, [3], 1, group_idx=0, kv_cache_spec_kind="sliding_window", session_id="s")
    enc = msgspec.msgpack.decode(encode_batch([full], 0.0))[1][0]
    assert (
        enc["group_idx"] == 0 and enc["kv_cache_spec_kind"] == "sliding_window" and enc["session_id"] == "s"
    )
    assert "locality" not in enc and "kv_cache_spec_sliding_window" not in enc


def test_encode_rejects_non_events():
    with pytest.raises(TypeError, match="not a KV event"):
        encode_batch([{"type": "BlockRemoved"}], 0.0)  # type: ignore[list-item]


def test_missing_trailing_fields_and_unknown_extra_fields():
    old = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [5, 6], 2], ["BlockRemoved", [1]]]])
    batch = decode_batch(old)
    assert batch.events == [BlockStored([1], None, [5, 6], 2), BlockRemoved([1])]
    assert batch.data_parallel_rank is None
    newer = msgspec.msgpack.encode(
        [
            2.0,
            [
                ["BlockRemoved", [1], "CPU", 0, "LOCAL", "tier", "future-field", 3],
                {"type": "AllBlocksCleared", "why": "x"},
            ],
            0,
        ]
    )
    assert decode_batch(newer) == KVEventBatch(
        2.0, [BlockRemoved([1], "CPU", 0, "LOCAL", "tier"), AllBlocksCleared()], 0
    )
    stored_map = {
        "type": "BlockStored",
        "block_hashes": [b"\x01"],
        "parent_block_hash": 5,
        "token_ids": [1],
        "block_size": 1,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "kv_cache_spec_kind": "mamba",
        "some_future_key": {"nested": [1, 2]},
    }
    assert decode_batch(msgspec.msgpack.encode([3.0, [stored_map]])).events == [
        BlockStored([b"\x01"], 5, [1], 1, medium="CPU", kv_cache_spec_kind="mamba")
    ]


def test_lenient_map_events_take_defaults():
    """Maps that omit everything but block_hashes (the old map form, third-party publishers)."""
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [{"type": "BlockStored", "block_hashes": [1, 2]}, {"type": "BlockRemoved", "block_hashes": [3]}],
        ]
    )
    assert decode_batch(payload).events == [BlockStored([1, 2], None, [], 0), BlockRemoved([3])]
    assert normalize_event({"type": "BlockRemoved", "block_hashes": [3], "x": 1}) == BlockRemoved([3])
    assert normalize_event(("AllBlocksCleared", "extra")) == AllBlocksCleared()


@settings(max_examples=200, deadline=None)
@given(ev=st.one_of(stored, removed), keep=st.sets(st.integers(min_value=1, max_value=13)))
def test_map_events_missing_any_field_but_block_hashes_take_the_public_defaults(ev, keep):
    """Every public field but ``block_hashes`` may be missing from a map event: each missing one
    takes its default (vLLM's required BlockStored keys: nil, empty, 0), the present ones survive."""
    names = ev.__struct_fields__
    kept = {"block_hashes", *(names[i] for i in keep if i < len(names))}
    raw = {"type": type(ev).__name__, **{n: getattr(ev, n) for n in names if n in kept}}
    lenient = {"parent_block_hash": None, "token_ids": [], "block_size": 0}
    fields = {n: getattr(ev, n) if n in kept else lenient.get(n) for n in names}
    expected = type(ev)(**fields)
    assert normalize_event(raw) == expected
    assert decode_batch(msgspec.msgpack.encode([1.0, [raw]])).events == [expected]


def test_int_ts_and_map_batch_without_rank():
    assert decode_batch(msgspec.msgpack.encode([5, []])) == KVEventBatch(5.0, [], None)
    assert decode_batch(msgspec.msgpack.encode({"ts": 5, "events": [{"type": "AllBlocksCleared"}]})) == (
        KVEventBatch(5.0, [AllBlocksCleared()], None)
    )


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
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [], 16, None, None, None, None, None, 3]]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "locality": 7}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "group_idx": "g"}]]),
        msgspec.msgpack.encode([1.0, [{"type": "Nope", "block_hashes": [1]}]]),
        msgspec.msgpack.encode([1.0, [{"no": "type"}]]),
        msgspec.msgpack.encode([1.0, [{1: "int key"}]]),
        msgspec.msgpack.encode([1.0, [7]]),
        msgspec.msgpack.encode([True, []]),
        msgspec.msgpack.encode([1.0, [], "rank"]),
        msgspec.msgpack.encode({"ts": "x", "events": []}),
        msgspec.msgpack.encode({"events": []}),
        msgspec.msgpack.encode({"ts": 1.0, "events": {}}),
    ],
)
def test_malformed_payloads_raise_protocol_error(raw):
    with pytest.raises(ProtocolError):
        decode_batch(raw)


def test_json_form_has_the_documented_keys():
    keys = {
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_name",
        "medium",
        "group_idx",
        "kv_cache_spec_kind",
    }
    for ev in (BlockStored([b"\x01"], 3, [1], 1), BlockRemoved([1]), AllBlocksCleared()):
        d = event_to_json_dict(ev)
        assert set(d) == keys
    assert event_to_json_dict(BlockStored([b"\x01\xff"], None, [1], 1))["block_hashes"] == ["01ff"]
    d = event_to_json_dict(BlockStored([1], None, [1], 1, group_idx=2, kv_cache_spec_kind="mamba"))
    assert d["group_idx"] == 2 and d["kv_cache_spec_kind"] == "mamba"
    assert event_to_json_dict(BlockRemoved([1], group_idx=1))["group_idx"] == 1


def test_well_formed_payloads_take_the_typed_paths(monkeypatch):
    """Map events, positional events and map batches never reach the generic per-event path."""
    import kvmesh.core.events as events_mod

    def no_generic(*args, **kwargs):
        raise AssertionError("generic path used")

    monkeypatch.setattr(events_mod, "_normalize_batch", no_generic)
    monkeypatch.setattr(events_mod, "normalize_event", no_generic)
    evs: list[KVEvent] = [
        BlockStored([1, 2], None, list(range(32)), 16, kv_cache_spec_kind="full_attention"),
        BlockRemoved([1]),
    ]
    batch = KVEventBatch(1.0, evs, 0)
    for payload in (
        encode_batch(evs, 1.0, 0),
        msgspec.msgpack.encode([1.0, [event_array(ev) for ev in evs], 0]),
        msgspec.msgpack.encode(to_map_batch(batch)),
    ):
        assert decode_batch(payload) == batch


def test_wire_media_map_to_tiers() -> None:
    from kvmesh.core.types import Medium

    assert Medium.parse(None) is Medium.GPU and Medium.parse("gpu") is Medium.GPU
    assert Medium.parse("CPU") is Medium.CPU and Medium.parse("host") is Medium.CPU
    assert Medium.parse("STORAGE") is Medium.DISK  # vLLM's MEDIUM_STORAGE (offloaded to storage)
    assert Medium.parse("valkey") is Medium.SHARED
