"""vLLM's own prefix-cache block hash, bit for bit, for interop and debugging.

vLLM v1 hashes block ``i`` as ``sha256(cbor2.dumps((parent, tuple(tokens_i), extra_keys),
canonical=True))`` with ``parent = NONE_HASH`` for the first block, where
``NONE_HASH = sha256(cbor2.dumps(seed, canonical=True))`` and ``seed`` is the ``PYTHONHASHSEED``
string of the vLLM process. (A vLLM started without ``PYTHONHASHSEED`` draws a random NONE_HASH, so
its hashes cannot be reproduced anywhere; kvmesh then falls back to the fixed seed below.)

``extra_keys`` is ``None`` when empty; otherwise a tuple of the LoRA name (every block) and the
request's ``cache_salt`` (block 0 only). KV events carry the hash as the last 8 bytes read as a
big-endian u64 when vLLM runs with integer block hashes, or as the raw 32 bytes.

The router does not need these hashes to route (it re-hashes ``token_ids``); they serve to match
an engine's BlockRemoved ids and to check a pod's hashing from the command line.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import cbor2

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def sha256_cbor(value: Any) -> bytes:
    """sha256 of the canonical CBOR encoding of ``value`` (vLLM's ``sha256_cbor``)."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash(seed: str | None = None) -> bytes:
    """The parent hash of block 0.

    Args:
        seed: the vLLM process's ``PYTHONHASHSEED``; ``None`` reads it from this process's
            environment and falls back to :data:`DEFAULT_NONE_HASH_SEED`.
    """
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED") or DEFAULT_NONE_HASH_SEED
    return sha256_cbor(seed)


def block_extra_keys(
    block_index: int, lora_name: str | None, cache_salt: str | None
) -> tuple[Any, ...] | None:
    """The ``extra_keys`` vLLM mixes into block ``block_index``'s hash."""
    keys: list[Any] = []
    if lora_name:
        keys.append(lora_name)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def vllm_block_hashes(
    tokens: Sequence[int],
    block_size: int = 16,
    *,
    seed: str | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    extra_keys: Sequence[Any] | None = None,
) -> list[bytes]:
    """vLLM's 32-byte block hashes for every full block of ``tokens``.

    Args:
        extra_keys: explicit extra keys for every block; overrides ``lora_name``/``cache_salt``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = none_hash(seed)
    hashes: list[bytes] = []
    for i in range(len(tokens) // block_size):
        block = tuple(int(t) for t in tokens[i * block_size : (i + 1) * block_size])
        extra = tuple(extra_keys) if extra_keys else block_extra_keys(i, lora_name, cache_salt)
        parent = sha256_cbor((parent, block, extra))
        hashes.append(parent)
    return hashes


def to_wire_u64(block_hash: bytes) -> int:
    """The u64 vLLM publishes for a hash in integer mode: last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")
