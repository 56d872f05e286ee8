"""Block and chunk keys.

Tokens are cut into blocks of ``block_size`` tokens (only full blocks are keyed). Keys are chained::

    h_0 = H(namespace)                 namespace = model, revision, LoRA, tenant salt
    h_i = H(h_{i-1} || tokens_i)       tokens_i as u32 little-endian

    tokens   |  block 0  |  block 1  |  ...  |  block 15 |  block 16 | ...
    keys        h_1         h_2                 h_16        h_17
    chunks   |<------------- chunk 0 (256 tokens) ------->|<--- chunk 1 ...
    chunk key                                   h_16

A store chunk is ``chunk_size`` tokens and its key is the chain value at its last block, so router
blocks and store chunks name the same prefix with the same bytes.

``H`` defaults to sha256 truncated to 16 bytes: a tenant must not be able to forge a key that
poisons another tenant's prefix. ``xxh3_128`` is there for speed when every tenant is trusted.

vLLM's own recipe (``sha256`` over canonical CBOR) lives in :mod:`kvmesh.core.vllm_hashing`.
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import cast

import numpy as np
import xxhash

from kvmesh.core.types import BlockKey

KEY_BYTES = 16
DEFAULT_BLOCK_SIZE = 16
DEFAULT_CHUNK_SIZE = 256
_MAX_TOKEN_ID = 2**32 - 1

_xxh3 = xxhash.xxh3_128_digest


class HashAlgo(StrEnum):
    """The digest behind the key chain."""

    SHA256 = "sha256"
    XXH3 = "xxh3"


def _digest(algo: HashAlgo, data: bytes) -> BlockKey:
    if algo is HashAlgo.SHA256:
        return BlockKey(hashlib.sha256(data).digest()[:KEY_BYTES])
    return BlockKey(xxhash.xxh3_128_digest(data))


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that must differ for two identical token sequences to have different KV.

    Router block keys use model, revision, LoRA and tenant. Store keys add the KV dtype and layout
    (see :meth:`for_store`), because the same prefix stored as bf16 and as int8 are different bytes.
    """

    model: str
    revision: str = ""
    lora: str = ""
    tenant: str = ""
    kv_dtype: str = ""
    kv_layout: str = ""

    def for_store(self, kv_dtype: str, kv_layout: str) -> Namespace:
        """Return this namespace extended with the KV format, for store keys."""
        return Namespace(self.model, self.revision, self.lora, self.tenant, kv_dtype, kv_layout)

    def for_tenant(self, tenant: str) -> Namespace:
        """Return this namespace with ``tenant`` as the salt."""
        return Namespace(self.model, self.revision, self.lora, tenant, self.kv_dtype, self.kv_layout)

    def encode(self) -> bytes:
        """Canonical bytes: each field length-prefixed so no two namespaces encode alike."""
        parts = [b"kvmesh-ns-v1"]
        for value in (self.model, self.revision, self.lora, self.tenant, self.kv_dtype, self.kv_layout):
            raw = value.encode("utf-8")
            parts.append(len(raw).to_bytes(4, "little"))
            parts.append(raw)
        return b"".join(parts)

    def label(self) -> str:
        """A short human-readable form for logs and metrics labels."""
        extras = [f"{k}={v}" for k, v in (("rev", self.revision), ("lora", self.lora)) if v]
        return ",".join([self.model, *extras])


_FAST_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"
"""``array.array("I")`` is u32 little-endian here: lists of ids pack through it, about 3-5x faster
than numpy, which checks the range on the way."""


_U32_LE = np.dtype("<u4")


def as_token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a little-endian u32 array, converted once (5x faster than ``np.asarray`` on lists).

    Raises:
        ValueError: an id is not an integer in [0, 2^32).
    """
    if isinstance(tokens, np.ndarray):
        return tokens
    if _FAST_U32:
        try:
            return np.frombuffer(array.array("I", tokens), dtype="<u4")
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be integers in [0, 2^32): {exc}") from exc
    return np.asarray(tokens, dtype="<u4")


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Pack token ids as u32 little-endian.

    Raises:
        ValueError: a token id is negative or does not fit in 32 bits.
    """
    if isinstance(tokens, list) and _FAST_U32:
        try:
            return array.array("I", tokens).tobytes()
        except (OverflowError, TypeError):
            pass  # numpy below names what is wrong
    elif isinstance(tokens, np.ndarray) and tokens.dtype == _U32_LE and tokens.ndim == 1:
        return tokens.tobytes()  # every u32 is a valid id: no range check needed
    arr = np.asarray(tokens)
    if arr.size == 0:
        return b""
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _MAX_TOKEN_ID:
        raise ValueError(f"token ids must lie in [0, {_MAX_TOKEN_ID}], got range [{lo}, {hi}]")
    return arr.astype("<u4", copy=False).tobytes()


@dataclass(slots=True)
class BlockHasher:
    """Computes the key chain of a token sequence for one namespace.

    Args:
        namespace: model/revision/LoRA/tenant (and, for the store, KV format).
        block_size: tokens per block; only full blocks get a key.
        algo: digest behind the chain.
    """

    namespace: Namespace
    block_size: int = DEFAULT_BLOCK_SIZE
    algo: HashAlgo = HashAlgo.SHA256
    _root: BlockKey = field(init=False)
    _block_format: str = field(init=False, repr=False, compare=False)
    """struct's format of one packed block (formatted once: it costs about 0.1 µs a call)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        self.algo = HashAlgo(self.algo)
        self._root = _digest(self.algo, self.namespace.encode())
        self._block_format = f"{self.block_size * 4}s"

    @property
    def root(self) -> BlockKey:
        """``h_0``: the chain value before the first block."""
        return self._root

    def num_full_blocks(self, num_tokens: int) -> int:
        """How many full blocks ``num_tokens`` tokens make."""
        return num_tokens // self.block_size

    def hash_blocks(
        self,
        tokens: Sequence[int] | np.ndarray,
        parent: BlockKey | None = None,
        max_blocks: int | None = None,
    ) -> list[BlockKey]:
        """Key every full block of ``tokens``.

        Args:
            tokens: token ids; a trailing partial block is ignored.
            parent: chain value before ``tokens[0]``; ``None`` means the namespace root, i.e.
                ``tokens`` starts the prompt. Pass the last key of a previous call to extend a chain.
            max_blocks: stop after this many blocks.

        Returns:
            One key per full block, in order.
        """
        n_blocks = len(tokens) // self.block_size
        if max_blocks is not None:
            n_blocks = min(n_blocks, max_blocks)
        if n_blocks == 0:
            return []
        return self.hash_packed(tokens_to_bytes(tokens[: n_blocks * self.block_size]), parent)

    def hash_packed(self, raw: bytes, parent: BlockKey | None = None) -> list[BlockKey]:
        """Key every full block of ``raw``, token ids already packed as u32 little-endian.

        Args:
            raw: packed token ids (:func:`tokens_to_bytes`); a trailing partial block is ignored.
            parent: as for :meth:`hash_blocks`.
        """
        stride = self.block_size * 4
        prev: bytes = self._root if parent is None else parent
        if len(raw) == stride:  # one block, as an engine announces each while decoding
            data = prev + raw
            key = hashlib.sha256(data).digest()[:KEY_BYTES] if self.algo is HashAlgo.SHA256 else _xxh3(data)
            return cast(list[BlockKey], [key])
        cut = len(raw) % stride
        blocks = memoryview(raw)[: len(raw) - cut] if cut else raw
        # One comprehension over struct's split: per block one concat and one digest call, no
        # slicing arithmetic or method lookups (plain bytes: the BlockKey NewType call costs too).
        split = struct.iter_unpack(self._block_format, blocks)
        if self.algo is HashAlgo.SHA256:
            sha = hashlib.sha256
            keys = [prev := sha(prev + block).digest()[:KEY_BYTES] for (block,) in split]
        else:
            keys = [prev := _xxh3(prev + block) for (block,) in split]
        return cast(list[BlockKey], keys)

    def hash_each(self, raw: bytes, parents: Sequence[BlockKey]) -> list[BlockKey]:
        """The key of each block of ``raw`` after its own parent: single blocks of different
        chains (one-block events of several requests), digested in one pass.

        Args:
            raw: ``len(parents)`` whole blocks of packed token ids.
            parents: each block's chain value before it.
        """
        assert len(raw) == len(parents) * self.block_size * 4, f"{len(raw)} bytes for {len(parents)} blocks"
        split = struct.iter_unpack(self._block_format, raw)
        if self.algo is HashAlgo.SHA256:
            sha = hashlib.sha256
            keys = [
                sha(parent + block).digest()[:KEY_BYTES]
                for parent, (block,) in zip(parents, split, strict=True)
            ]
        else:
            keys = [_xxh3(parent + block) for parent, (block,) in zip(parents, split, strict=True)]
        return cast(list[BlockKey], keys)

    def hash_packed_with_inputs(
        self, raw: bytes, parent: BlockKey | None = None
    ) -> tuple[list[BlockKey], list[bytes]]:
        """:meth:`hash_packed`, and each block's digest input (its parent's key, then its packed
        tokens), for a caller that keeps keys by their input (the router's key memo)."""
        stride = self.block_size * 4
        cut = len(raw) % stride
        blocks = memoryview(raw)[: len(raw) - cut] if cut else raw
        prev: bytes = self._root if parent is None else parent
        inputs: list[bytes] = []
        keep = inputs.append
        split = struct.iter_unpack(self._block_format, blocks)
        # ``keep(x) or x`` is ``x``, kept on the way: the concatenation is made once for both uses.
        if self.algo is HashAlgo.SHA256:
            sha = hashlib.sha256
            keys = [
                prev := sha(keep(data := prev + block) or data).digest()[:KEY_BYTES] for (block,) in split
            ]
        else:
            keys = [prev := _xxh3(keep(data := prev + block) or data) for (block,) in split]
        return cast(list[BlockKey], keys), inputs

    def chunk_keys(
        self, tokens: Sequence[int] | np.ndarray, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> list[BlockKey]:
        """Key every full chunk of ``tokens``: the chain value at each chunk's last block.

        Raises:
            ValueError: ``chunk_size`` is not a positive multiple of ``block_size``.
        """
        blocks_per_chunk = self.blocks_per_chunk(chunk_size)
        keys = self.hash_blocks(tokens)
        return keys[blocks_per_chunk - 1 :: blocks_per_chunk]

    def blocks_per_chunk(self, chunk_size: int) -> int:
        """Blocks in one chunk; validates that chunks line up with blocks."""
        if chunk_size <= 0 or chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size must be a positive multiple of block_size={self.block_size}, got {chunk_size}"
            )
        return chunk_size // self.block_size


def hex_key(key: BlockKey) -> str:
    """Hex form of a key, for logs, file names and Redis keys."""
    return key.hex()


def key_from_hex(text: str) -> BlockKey:
    """Inverse of :func:`hex_key`.

    Raises:
        ValueError: ``text`` is not hex of a key's length.
    """
    raw = bytes.fromhex(text)
    if len(raw) != KEY_BYTES:
        raise ValueError(f"a block key is {KEY_BYTES} bytes, got {len(raw)}")
    return BlockKey(raw)
