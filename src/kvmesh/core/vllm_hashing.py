"""vLLM's own prefix-cache block hash (``sha256_cbor``), bit for bit, for interop and debugging.

vLLM v1 hashes block ``i`` as ``sha256(cbor2.dumps((parent, tuple(tokens_i), extra_keys),
canonical=True))`` with ``parent = NONE_HASH`` for the first block, where
``NONE_HASH = sha256(cbor2.dumps(seed, canonical=True))``. The seed is the vLLM process's
``PYTHONHASHSEED`` whenever that variable is *set*, even to the empty string; when it is unset,
vLLM 0.32 uses the fixed seed :data:`DEFAULT_NONE_HASH_SEED` for the sha256 family. (For the xxhash
family, and for sha256 in vLLM releases before the fixed seed, an unset ``PYTHONHASHSEED`` gives a
random per-process NONE_HASH that nothing outside that process can reproduce.)

``extra_keys`` is ``None`` when a block has none. vLLM 0.32 tags each key with its kind:
``("lora", lora_name, lora_path)`` on every block of a LoRA request and ``("cache_salt", salt)``
on block 0 only, in that order (multimodal and prompt-embeds keys, which sit between and after
them, are not modelled here). Older vLLM used bare strings: the LoRA name, then the salt; select
that recipe with ``legacy_extra_keys=True``.

KV events publish extra keys *untagged* (:func:`to_event_extra_keys`: a LoRA key becomes its
name, the path is dropped, a salt becomes the bare salt) and the hash as the last 8 bytes read as
a big-endian u64 when vLLM runs with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (its default), or as
the raw 32 bytes otherwise (:func:`to_wire`).

The router does not need these hashes to route (it re-hashes ``token_ids``); they serve to match
an engine's BlockRemoved ids and to check a pod's hashing from the command line.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import cbor2

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's NONE_HASH seed for the sha256 family when ``PYTHONHASHSEED`` is unset."""

LORA_TAG = "lora"
CACHE_SALT_TAG = "cache_salt"
MM_TAG = "mm"

_U64_MASK = (1 << 64) - 1


def sha256_cbor(value: Any) -> bytes:
    """sha256 of the canonical CBOR encoding of ``value`` (vLLM's ``sha256_cbor``)."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def resolve_seed(seed: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The NONE_HASH seed a vLLM process (sha256 family) derives its first parent from.

    Args:
        seed: an explicit seed; wins when not ``None`` (``""`` is a seed like any other).
        environ: the vLLM process's environment; ``None`` reads this process's. A
            ``PYTHONHASHSEED`` that is set, even to ``""``, is the seed; an unset one gives
            :data:`DEFAULT_NONE_HASH_SEED`.
    """
    if seed is not None:
        return seed
    env = os.environ if environ is None else environ
    value = env.get("PYTHONHASHSEED")
    return DEFAULT_NONE_HASH_SEED if value is None else value


def none_hash(seed: str | None = None) -> bytes:
    """The parent hash of block 0.

    Args:
        seed: the vLLM process's ``PYTHONHASHSEED``; ``None`` resolves it from this process's
            environment as vLLM does (see :func:`resolve_seed`).
    """
    return sha256_cbor(resolve_seed(seed))


def hash_block(parent: bytes, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None = None) -> bytes:
    """One block's hash given its parent's hash (vLLM's ``hash_block_tokens`` with sha256_cbor)."""
    return sha256_cbor((parent, tuple(int(t) for t in tokens), extra_keys))


def lora_extra_key(lora_name: str, lora_path: str | None) -> tuple[str, str, str]:
    """vLLM 0.32's tagged LoRA key, ``("lora", name, path)``.

    Raises:
        ValueError: ``lora_path`` is empty; vLLM refuses a LoRA request without a path, so no
            vLLM 0.32 hash can be reproduced without it.
    """
    if not lora_path:
        raise ValueError(
            "vLLM 0.32 hashes the LoRA adapter path with its name: give lora_path (--lora-path), "
            "or select older vLLM's untagged recipe (legacy_extra_keys, --legacy-extra-keys)"
        )
    return (LORA_TAG, lora_name, lora_path)


def block_extra_keys(
    block_index: int,
    lora_name: str | None,
    cache_salt: str | None,
    *,
    lora_path: str | None = None,
    legacy_extra_keys: bool = False,
) -> tuple[Any, ...] | None:
    """The ``extra_keys`` vLLM mixes into block ``block_index``'s hash.

    Args:
        lora_name: the request's LoRA name, or ``None`` for no LoRA.
        cache_salt: the request's ``cache_salt``; falsy means none (as in vLLM).
        lora_path: the LoRA adapter's path; required with ``lora_name`` unless legacy.
        legacy_extra_keys: older vLLM's bare-string keys (``lora_name``, then ``cache_salt``)
            instead of vLLM 0.32's tagged tuples; ``lora_path`` is then ignored.
    """
    keys: list[Any] = []
    if lora_name is not None:
        keys.append(lora_name if legacy_extra_keys else lora_extra_key(lora_name, lora_path))
    if cache_salt and block_index == 0:
        keys.append(cache_salt if legacy_extra_keys else (CACHE_SALT_TAG, cache_salt))
    return tuple(keys) if keys else None


def vllm_block_hashes(
    tokens: Sequence[int],
    block_size: int = 16,
    *,
    seed: str | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    extra_keys: Sequence[Any] | None = None,
    legacy_extra_keys: bool = False,
) -> list[bytes]:
    """vLLM's 32-byte block hashes for every full block of ``tokens``.

    Args:
        seed: the vLLM process's ``PYTHONHASHSEED``; ``None`` resolves it as vLLM does.
        lora_name, lora_path, cache_salt, legacy_extra_keys: see :func:`block_extra_keys`.
        extra_keys: explicit extra keys for every block, used as given; overrides
            ``lora_name``/``lora_path``/``cache_salt``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if lora_name is not None and not legacy_extra_keys and not extra_keys:
        lora_extra_key(lora_name, lora_path)  # fail before hashing anything
    parent = none_hash(seed)
    hashes: list[bytes] = []
    for i in range(len(tokens) // block_size):
        extra = (
            tuple(extra_keys)
            if extra_keys
            else block_extra_keys(
                i, lora_name, cache_salt, lora_path=lora_path, legacy_extra_keys=legacy_extra_keys
            )
        )
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


def event_extra_key(key: Any) -> Any:
    """One tagged extra key in its KV-event form: ``("mm", id, offset)`` → ``(id, offset)``,
    any other ``(tag, value, ...)`` → ``value`` (so a LoRA key publishes only its name).

    Raises:
        ValueError: ``key`` is not a tagged tuple (e.g. a legacy bare string).
    """
    if not isinstance(key, tuple) or len(key) < 2 or not isinstance(key[0], str):
        raise ValueError(f"not a tagged vLLM extra key: {key!r}")
    return key[1:] if key[0] == MM_TAG else key[1]


def to_event_extra_keys(
    extra_keys: Iterable[tuple[Any, ...] | None] | None,
) -> list[tuple[Any, ...] | None] | None:
    """Per-block tagged extra keys → the untagged per-block list vLLM publishes in KV events.

    ``None`` or an empty list gives ``None``; a block without keys stays ``None``.
    """
    if not extra_keys:
        return None
    event_keys = [None if keys is None else tuple(event_extra_key(k) for k in keys) for keys in extra_keys]
    return event_keys or None


def to_wire_u64(block_hash: bytes) -> int:
    """The u64 vLLM publishes for a hash in integer mode: last 8 bytes, big-endian."""
    return int.from_bytes(block_hash, "big") & _U64_MASK


def to_wire(block_hash: bytes, use_int_block_hashes: bool = True) -> int | bytes:
    """The hash as vLLM's KV events carry it: the u64 of :func:`to_wire_u64` when vLLM runs with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (its default), else the raw bytes."""
    return to_wire_u64(block_hash) if use_int_block_hashes else block_hash
