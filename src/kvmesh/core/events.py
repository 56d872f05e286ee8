"""KV cache events in vLLM's wire format.

A replica announces which blocks it holds with a stream of batches::

    batch  = [ts: float, events: list[event], data_parallel_rank: int | None]
    event  = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
              lora_id, medium, lora_name, extra_keys, group_idx]
           | ["BlockRemoved", block_hashes, medium, group_idx]
           | ["AllBlocksCleared"]

The encoder writes this positional (array) form with trailing defaults omitted, as vLLM does. The
decoder also takes the map form ``{"type": "BlockStored", ...}``, missing trailing fields, unknown
extra trailing fields, and block hashes as u64 ints or raw bytes. Frames that still do not parse
raise :class:`~kvmesh.errors.ProtocolError`; the subscriber counts and skips them.
"""

from __future__ import annotations

import time
from typing import Any, TypeAlias

import msgspec

from kvmesh.core.types import ExternalBlockHash
from kvmesh.errors import ProtocolError


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three event kinds; the tag is the class name, first in the array."""


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
    """Tier holding the blocks: "GPU", "CPU", "DISK", ... (``None`` means GPU)."""
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks were evicted from ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The publisher dropped every block it held."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared

_EVENT_TYPES: dict[str, type[KVCacheEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: a timestamp, the events, and the publisher's DP rank."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# msgspec raises UnicodeDecodeError (a ValueError) for invalid UTF-8 inside str fields.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError)
_encoder = msgspec.msgpack.Encoder()
_fast_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_any_decoder = msgspec.msgpack.Decoder()


def encode_batch(
    events: list[KVEvent], ts: float | None = None, data_parallel_rank: int | None = None
) -> bytes:
    """Serialize events as one vLLM batch payload."""
    return _encoder.encode(KVEventBatch(time.time() if ts is None else ts, events, data_parallel_rank))


def decode_batch(payload: bytes) -> KVEventBatch:
    """Parse one batch payload in any accepted form.

    Raises:
        ProtocolError: the payload is not a KV event batch.
    """
    try:
        return _fast_decoder.decode(payload)
    except _DECODE_ERRORS:
        pass
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
    """Build a typed event from a generic decoded array or map.

    Raises:
        ProtocolError: unknown type tag or fields of the wrong type.
    """
    if isinstance(raw, dict):
        tag = raw.get("type")
        cls = _EVENT_TYPES.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise ProtocolError(f"unknown event type {tag!r}")
        fields = cls.__struct_fields__
        # Unknown keys are dropped (newer publishers append fields); known ones are validated.
        values = {k: v for k, v in raw.items() if k in fields}
        try:
            return msgspec.convert(values, type=_MAP_FORMS[cls])._to_event()
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"bad {tag} event: {exc}") from exc
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        cls = _EVENT_TYPES.get(raw[0])
        if cls is None:
            raise ProtocolError(f"unknown event type {raw[0]!r}")
        body = list(raw[1 : 1 + len(cls.__struct_fields__)])
        try:
            return msgspec.convert([raw[0], *body], type=KVEvent)
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"bad {raw[0]} event: {exc}") from exc
    raise ProtocolError(f"event must be a tagged array or a map with 'type', got {type(raw).__name__}")


class _BlockStoredMap(msgspec.Struct):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None

    def _to_event(self) -> KVEvent:
        return BlockStored(
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids,
            self.block_size,
            self.lora_id,
            self.medium,
            self.lora_name,
            self.extra_keys,
            self.group_idx,
        )


class _BlockRemovedMap(msgspec.Struct):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None

    def _to_event(self) -> KVEvent:
        return BlockRemoved(self.block_hashes, self.medium, self.group_idx)


class _AllBlocksClearedMap(msgspec.Struct):
    def _to_event(self) -> KVEvent:
        return AllBlocksCleared()


_MAP_FORMS: dict[type[KVCacheEvent], Any] = {
    BlockStored: _BlockStoredMap,
    BlockRemoved: _BlockRemovedMap,
    AllBlocksCleared: _AllBlocksClearedMap,
}


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
            }
    raise AssertionError(f"unhandled event type {type(event).__name__}")
