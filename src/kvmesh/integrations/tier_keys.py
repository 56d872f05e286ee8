"""How vLLM's offloaded chunks are named and shaped in the kvmesh store.

vLLM's ``OffloadKey`` is a block hash followed by the KV cache group (4 bytes). Two vLLM servers
of one model, hash seed and offloading layout compute the same keys for the same prefix, so the
store key is derived from it alone (plus the chunk's size, so servers whose chunks differ in
layout never read each other's bytes)::

    OffloadKey ──sha256("kvmesh-vllm-offload-v1", chunk bytes, key)──► StoreKey(group, chunk)

A chunk is an opaque row of the CPU tier; the codec stores it as a raw array shaped
``(1, 2, 1, 1, n)`` of 16-bit words, so its checksum (and HMAC) cover it and nothing reinterprets
its values. Only the raw codec keeps arbitrary bits intact, hence :data:`RAW_ONLY`.
"""

from __future__ import annotations

import hashlib

import numpy as np

from kvmesh.core.hashing import Namespace
from kvmesh.core.types import BlockKey
from kvmesh.store.keys import StoreKey, namespace_group

RAW_ONLY = "raw"
"""The only codec the tier accepts: quantizing codecs would change the bytes vLLM reads back."""

_KEY_DOMAIN = b"kvmesh-vllm-offload-v1\0"
_WORD_BYTES = 2
_HALVES = 2


def tier_group(model: str, revision: str = "") -> str:
    """The store's flush group for a model's offloaded chunks (``kvmesh store flush`` drops them)."""
    return namespace_group(Namespace(model, revision, kv_layout="vllm-offload"))


def offload_store_key(group: str, offload_key: bytes, chunk_bytes: int) -> StoreKey:
    """The store key of one vLLM chunk of ``chunk_bytes`` bytes."""
    digest = hashlib.sha256(_KEY_DOMAIN + chunk_bytes.to_bytes(8, "big") + bytes(offload_key)).digest()
    return StoreKey(group, BlockKey(digest))


def check_chunk_bytes(chunk_bytes: int) -> None:
    """Raise ``ValueError`` when a chunk cannot be framed as two halves of 16-bit words."""
    if chunk_bytes <= 0 or chunk_bytes % (_WORD_BYTES * _HALVES):
        raise ValueError(f"chunk size must be a positive multiple of 4 bytes, got {chunk_bytes}")


def chunk_array(row: np.ndarray) -> np.ndarray:
    """A zero-copy view of one CPU-tier row (bytes), shaped as the codec wants a chunk."""
    words = np.ascontiguousarray(row).view(np.uint16)
    return words.reshape(1, _HALVES, 1, 1, words.size // _HALVES)
