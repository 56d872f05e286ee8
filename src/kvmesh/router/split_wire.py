"""The index writes router workers send each other when they split event ingestion
(:mod:`~kvmesh.router.ingest_split`): one msgpack message per burst of writes, keys packed end to end."""

from __future__ import annotations

from enum import IntEnum

import msgspec

from kvmesh.core.hashing import KEY_BYTES
from kvmesh.core.types import BlockKey


class OpKind(IntEnum):
    ADD = 0
    REMOVE = 1
    CLEAR = 2
    BLOCK_SIZE = 3


class IndexOp(msgspec.Struct, array_like=True, frozen=True):
    """One index write: ``arg`` is the tiers (ADD, REMOVE) or the engine block size (BLOCK_SIZE);
    ``keys`` the router keys, 16 bytes each, end to end."""

    kind: int
    pod: str
    arg: int = 0
    keys: bytes = b""


class IndexOps(msgspec.Struct, array_like=True, frozen=True):
    """A worker's writes since its previous message."""

    origin: int
    incarnation: int
    seq: int
    ops: list[IndexOp]


encode_ops = msgspec.msgpack.Encoder().encode
decode_ops = msgspec.msgpack.Decoder(IndexOps).decode


def split_keys(blob: bytes) -> list[BlockKey]:
    """The keys packed end to end in ``blob``.

    Raises:
        ValueError: its length is not a whole number of keys.
    """
    if len(blob) == KEY_BYTES:
        return [BlockKey(blob)]
    if len(blob) % KEY_BYTES:
        raise ValueError(f"{len(blob)} bytes is not a whole number of {KEY_BYTES}-byte keys")
    return [BlockKey(blob[i : i + KEY_BYTES]) for i in range(0, len(blob), KEY_BYTES)]
