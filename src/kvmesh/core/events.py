"""KV cache events in vLLM's wire format.

A replica announces which blocks it holds with a stream of msgpack batches. Since vLLM 0.32 the
batch is a positional array and every event is a map tagged by ``"type"``::

    batch  = [ts: float, events: list[event], data_parallel_rank: int | None]
    event  = {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
              "lora_id", "medium", "lora_name",                             (always written)
              "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
              "locality", "ownership", "session_id"}                        (written when not nil)
           | {"type": "BlockRemoved", "block_hashes", "medium",             (always written)
              "group_idx", "locality", "ownership"}                         (written when not nil)
           | {"type": "AllBlocksCleared"}

The batch always carries all three elements (msgspec ignores ``omit_defaults`` for array-like
structs, so a nil rank is written as nil, by vLLM and by us).

Each event is defined once, as the public struct below. Every other shape is derived from it
field for field (``msgspec.defstruct``), so the shapes cannot drift apart:

- *wire* (written by :func:`encode_batch`): vLLM's decoder requires the first seven ``BlockStored``
  keys (and the first two of ``BlockRemoved``) even when they are nil, while Python code here builds
  events with ``lora_id``, ``medium`` and ``lora_name`` defaulting to ``None``. msgspec decides per
  struct class whether nil defaults are written, so the wire shape has no default for those keys
  (always written) and omits the optional tail when nil: exactly the bytes vLLM's encoder writes.
  The public structs use ``omit_defaults=False``, so even a direct ``msgspec.msgpack.encode(event)``
  stays decodable by vLLM (just larger).
- *positional* (``array_like``) for older publishers' ``["BlockStored", block_hashes, ...]``:
  missing trailing fields take their defaults, unknown extra trailing fields are ignored.
- *lenient* map events (nothing but ``block_hashes`` required) need no shape of their own: the
  missing required keys are filled in and the map converted to the public struct.

Decoding, fastest first; every path ends in the public structs:

1. map-form events in an array batch (vLLM >= 0.32, and our encoder): one typed msgspec decode
   straight into :class:`KVEventBatch`; unknown keys are ignored, so newer publishers that add
   fields still take this path.
2. positional events in an array batch (older vLLM and older kvmesh): one typed decode into the
   positional shapes, then converted.
3. a map-form batch ``{"ts": ..., "events": [...], "data_parallel_rank": ...}``: one typed decode.
4. anything else (a batch mixing both event forms, map events missing fields other than
   ``block_hashes``): a generic msgpack decode and :func:`normalize_event` per event.

Block hashes may be u64 ints or raw bytes everywhere. A payload no path accepts raises
:class:`~kvmesh.errors.ProtocolError`; the subscriber counts and skips it.
"""

from __future__ import annotations

import functools
import operator
import time
from typing import Any, TypeAlias

import msgspec
from msgspec.structs import astuple

from kvmesh.core.types import ExternalBlockHash
from kvmesh.errors import ProtocolError

# --------------------------------------------------------------------------------------------------
# Public (canonical) events: map form, tag "type" = class name.


class KVCacheEvent(msgspec.Struct, omit_defaults=False, gc=False, tag=True):
    """Base of the three event kinds; encodes as a map whose ``"type"`` is the class name."""


class BlockStored(KVCacheEvent):
    """Blocks were cached. ``token_ids`` holds ``len(block_hashes) * block_size`` tokens."""

    block_hashes: list[ExternalBlockHash]
    """The engine's own hashes, one per block, in chain order."""
    parent_block_hash: ExternalBlockHash | None
    """Engine hash of the block before ``block_hashes[0]``; ``None`` when the chain starts here."""
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    """Deprecated upstream in favour of ``lora_name``; kept for old publishers."""
    medium: str | None = None
    """Tier holding the blocks: "GPU", "CPU", ... (``None`` means GPU)."""
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    """Per block: the extra hash inputs (LoRA name, multimodal ids, cache salt) or ``None``."""
    group_idx: int | None = None
    """KV cache group of a hybrid model; ``None`` for single-group models."""
    kv_cache_spec_kind: str | None = None
    """Kind of the group's cache spec: "full_attention", "sliding_window", "mamba", ..."""
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    """"LOCAL" or "REMOTE" relative to the publisher; ``None`` means unspecified."""
    ownership: str | None = None
    """Secondary offloading tier that generated the event, if any."""
    session_id: str | None = None
    """Session (request context) that triggered the store; not exclusive ownership."""


class BlockRemoved(KVCacheEvent):
    """Blocks were evicted from ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The publisher dropped every block it held."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: a timestamp, the events, and the publisher's DP rank."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# --------------------------------------------------------------------------------------------------
# The other shapes of each event are derived from the public struct above, field for field, so they
# cannot drift from it and convert to it positionally (``astuple``).


def _derive(
    event_type: type[KVCacheEvent], *, first_optional: int, omit_defaults: bool, array_like: bool
) -> type[msgspec.Struct]:
    """A struct of ``event_type``'s fields, in order, tagged by its name; fields before
    ``first_optional`` have no default, later ones keep the public default."""
    spec: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for i, f in enumerate(msgspec.structs.fields(event_type)):
        if i < first_optional or f.required:
            spec.append((f.name, f.type))
        elif f.default_factory is not msgspec.NODEFAULT:
            spec.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            spec.append((f.name, f.type, f.default))
    return msgspec.defstruct(
        f"_{event_type.__name__}{'Array' if array_like else 'Wire'}",
        spec,
        tag=event_type.__name__,
        omit_defaults=omit_defaults,
        array_like=array_like,
        gc=False,
        module=__name__,
    )


_PUBLIC_TYPES: tuple[type[KVCacheEvent], ...] = (BlockStored, BlockRemoved, AllBlocksCleared)
_EVENT_TYPES: dict[str, type[KVCacheEvent]] = {t.__name__: t for t in _PUBLIC_TYPES}

# Wire form written by encode_batch: vLLM's decoder needs the keys up to and including these even
# when nil, so they have no default (always written); the optional tail is omitted when nil.
_LAST_ALWAYS_WRITTEN = {BlockStored: "lora_name", BlockRemoved: "medium"}


def _always_written(event_type: type[KVCacheEvent]) -> int:
    last = _LAST_ALWAYS_WRITTEN.get(event_type)
    return 0 if last is None else event_type.__struct_fields__.index(last) + 1


_TO_WIRE: dict[type[KVCacheEvent], type[msgspec.Struct]] = {
    t: _derive(t, first_optional=_always_written(t), omit_defaults=True, array_like=False)
    for t in _PUBLIC_TYPES
}


class _WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[msgspec.Struct]
    data_parallel_rank: int | None = None


# Positional (array) form of older publishers: ["BlockStored", block_hashes, ...]. Trailing fields
# may be missing (defaults) or extra (ignored by msgspec for array_like structs).
_TO_PUBLIC: dict[type[msgspec.Struct], type[KVCacheEvent]] = {
    _derive(t, first_optional=0, omit_defaults=False, array_like=True): t for t in _PUBLIC_TYPES
}
_ArrayEventUnion: Any = functools.reduce(operator.or_, _TO_PUBLIC)

_ArrayEventsBatch = msgspec.defstruct(
    "_ArrayEventsBatch",
    [("ts", float), ("events", list[_ArrayEventUnion]), ("data_parallel_rank", int | None, None)],
    array_like=True,
    gc=False,
    module=__name__,
)


# Map-form batch.
class _MapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# Some third-party publishers send map-form BlockStored events with nothing but block_hashes: the
# generic path fills the other fields vLLM requires before a typed conversion (keys of other events
# are ignored, as unknown keys are).
_LENIENT_FILL: dict[str, Any] = {"parent_block_hash": None, "token_ids": (), "block_size": 0}

# msgspec raises UnicodeDecodeError (a ValueError) for invalid UTF-8 inside str fields.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError)
_encoder = msgspec.msgpack.Encoder()
_map_events_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_array_events_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(_ArrayEventsBatch)
_map_batch_decoder = msgspec.msgpack.Decoder(_MapBatch)
_any_decoder = msgspec.msgpack.Decoder()


def _to_public(twin: Any) -> KVEvent:
    event: KVEvent = _TO_PUBLIC[type(twin)](*astuple(twin))  # type: ignore[assignment]
    return event


def _to_wire_slow(event: object) -> msgspec.Struct:
    raise TypeError(f"not a KV event: {type(event).__name__}")


def encode_batch(
    events: list[KVEvent], ts: float | None = None, data_parallel_rank: int | None = None
) -> bytes:
    """Serialize events as one vLLM batch payload (byte-identical to vLLM's encoder)."""
    to_wire = _TO_WIRE.get
    wire = [w(*astuple(e)) if (w := to_wire(type(e))) is not None else _to_wire_slow(e) for e in events]
    return _encoder.encode(_WireBatch(time.time() if ts is None else ts, wire, data_parallel_rank))


def decode_batch(payload: bytes) -> KVEventBatch:
    """Parse one batch payload in any accepted form.

    Raises:
        ProtocolError: the payload is not a KV event batch.
    """
    # fixmap, map16, map32: a map-form batch.
    if payload[:1] and (0x80 <= payload[0] <= 0x8F or payload[0] in (0xDE, 0xDF)):
        try:
            mb = _map_batch_decoder.decode(payload)
        except _DECODE_ERRORS:
            pass
        else:
            return KVEventBatch(mb.ts, mb.events, mb.data_parallel_rank)
    else:
        try:
            return _map_events_decoder.decode(payload)
        except _DECODE_ERRORS:
            pass
        try:
            ab = _array_events_decoder.decode(payload)
        except _DECODE_ERRORS:
            pass
        else:
            return KVEventBatch(ab.ts, [_to_public(e) for e in ab.events], ab.data_parallel_rank)
    try:
        raw = _any_decoder.decode(payload)
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"not msgpack: {exc}") from exc
    return _normalize_batch(raw)


def _normalize_batch(raw: Any) -> KVEventBatch:
    if isinstance(raw, dict):
        ts, events, dp_rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list | tuple) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        dp_rank = raw[2] if len(raw) > 2 else None
    else:
        raise ProtocolError(f"batch must be [ts, events, dp_rank] or a map, got {type(raw).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise ProtocolError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list | tuple):
        raise ProtocolError(f"batch events must be a list, got {type(events).__name__}")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)):
        raise ProtocolError(f"data_parallel_rank must be an int or nil, got {type(dp_rank).__name__}")
    return KVEventBatch(float(ts), [normalize_event(ev) for ev in events], dp_rank)


def normalize_event(raw: Any) -> KVEvent:
    """Build a typed event from a generic decoded map (``{"type": ...}``) or positional array.

    Map events may omit every field but ``block_hashes``; unknown keys and unknown extra trailing
    array elements are ignored.

    Raises:
        ProtocolError: unknown type tag or fields of the wrong type.
    """
    if isinstance(raw, dict):
        tag = raw.get("type")
        public = _EVENT_TYPES.get(tag) if isinstance(tag, str) else None
        if public is None:
            raise ProtocolError(f"unknown event type {tag!r}")
        try:
            event: KVEvent = msgspec.convert({**_LENIENT_FILL, **raw}, type=public)  # type: ignore[assignment]
            return event
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"bad {tag} event: {exc}") from exc
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        cls = _EVENT_TYPES.get(raw[0])
        if cls is None:
            raise ProtocolError(f"unknown event type {raw[0]!r}")
        body = list(raw[: 1 + len(cls.__struct_fields__)])
        try:
            return _to_public(msgspec.convert(body, type=_ArrayEventUnion))
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"bad {raw[0]} event: {exc}") from exc
    raise ProtocolError(f"event must be a tagged array or a map with 'type', got {type(raw).__name__}")


def event_to_json_dict(event: KVEvent) -> dict[str, Any]:
    """The printable form used by ``kvmesh events decode|listen`` (bytes hashes as hex)."""

    def show(h: ExternalBlockHash | None) -> Any:
        return h.hex() if isinstance(h, bytes) else h

    match event:
        case BlockStored():
            return {
                "type": "BlockStored",
                "block_hashes": [show(h) for h in event.block_hashes],
                "parent_block_hash": show(event.parent_block_hash),
                "token_ids": event.token_ids,
                "block_size": event.block_size,
                "lora_name": event.lora_name,
                "medium": event.medium,
                "group_idx": event.group_idx,
                "kv_cache_spec_kind": event.kv_cache_spec_kind,
            }
        case BlockRemoved():
            return {
                "type": "BlockRemoved",
                "block_hashes": [show(h) for h in event.block_hashes],
                "parent_block_hash": None,
                "token_ids": None,
                "block_size": None,
                "lora_name": None,
                "medium": event.medium,
                "group_idx": event.group_idx,
                "kv_cache_spec_kind": None,
            }
        case AllBlocksCleared():
            return {
                "type": "AllBlocksCleared",
                "block_hashes": [],
                "parent_block_hash": None,
                "token_ids": None,
                "block_size": None,
                "lora_name": None,
                "medium": None,
                "group_idx": None,
                "kv_cache_spec_kind": None,
            }
    raise AssertionError(f"unhandled event type {type(event).__name__}")
