"""Memo of block keys the router has already computed from event tokens.

Hashing dominates prefix matching (one digest per 16 tokens). Every block in the index was hashed
once, when its BlockStored event arrived; the memo keeps that result::

    parent key (16 B) || block tokens as u32 LE (4·block_size B)  ──►  BlockKey

so matching a request whose prefix is cached somewhere costs a dict probe per block instead of a
digest. The probe bytes are exactly the digest's input, which makes a hit equal to what
:class:`~kvmesh.core.hashing.BlockHasher` would return (the parent carries namespace and digest
choice through the chain root). Blocks no engine announced are never memoized, so the memo only
ever speeds up matches and holds no more than the index knows. Bounded: oldest entries leave first,
a sixteenth of the capacity beyond the excess at a time.

The memo pays only where a digest costs more than a probe: with sha256 keys a probe is about 4x
cheaper than the digest it replaces; with xxh3 keys (the router's default) a probe costs what the
digest does (both ~0.16 µs a block at 8k tokens), so :func:`key_memo_for` keeps none and ingestion
skips keeping the digests' inputs and the memo's writes.

Written from the event loop only; ``get`` from a worker thread is safe (single dict lookups).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import struct
from collections.abc import Sequence

from kvmesh.core.hashing import HashAlgo
from kvmesh.core.types import BlockKey

DEFAULT_MEMO_CAPACITY = 262_144
_MISS = BlockKey(b"")
_EVICT_FRACTION = 16


def key_memo_for(algo: HashAlgo, capacity: int = DEFAULT_MEMO_CAPACITY) -> BlockKeyMemo | None:
    """The memo a router keeps for keys of ``algo``.

    Args:
        algo: the key digest.
        capacity: most entries kept (0: none kept).

    Returns:
        A memo, or ``None`` where it would not pay: capacity 0, or a digest no dearer than a probe
        (xxh3).
    """
    if capacity <= 0 or HashAlgo(algo) is HashAlgo.XXH3:
        return None
    return BlockKeyMemo(capacity)


class BlockKeyMemo:
    """Bounded map from a block's digest input to its key.

    Args:
        capacity: most entries kept (about 150 bytes each).
    """

    def __init__(self, capacity: int = DEFAULT_MEMO_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"memo capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._keys: dict[bytes, BlockKey] = {}
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._keys)

    def get(self, probe: bytes) -> BlockKey | None:
        """The key of ``parent || block tokens``, if memoized."""
        return self._keys.get(probe)

    def walk(self, parent: BlockKey, raw: bytes, stride: int) -> list[BlockKey]:
        """Keys of the leading blocks of ``raw`` that are memoized, stopping at the first miss.

        Args:
            parent: the chain value before the first block of ``raw`` (the hasher's root at a
                prompt's start).
            raw: the prompt's tokens as u32 little-endian bytes (whole blocks).
            stride: bytes per block (``4 * block_size``).
        """
        get = self._keys.get
        prev: bytes = parent
        whole = len(raw) - len(raw) % stride
        blocks = raw if whole == len(raw) else memoryview(raw)[:whole]
        # After a miss the chain is broken: later entries are discarded whatever they hold. The
        # comprehension and struct's splitting keep the per-block cost to one concat and a probe.
        out: list[BlockKey] = [
            prev := get(prev + block, _MISS) for (block,) in struct.iter_unpack(f"{stride}s", blocks)
        ]
        with contextlib.suppress(ValueError):
            del out[out.index(_MISS) :]
        return out

    def remember(self, parent: BlockKey, raw: bytes, keys: Sequence[BlockKey]) -> None:
        """Memoize a chain: ``keys[i]`` is the key of block ``i`` of ``raw`` after ``parent``.

        Args:
            parent: chain value before the first block (the hasher's root for a prompt start).
            raw: the blocks' tokens as u32 little-endian bytes, ``len(keys)`` blocks long.
            keys: the blocks' keys.
        """
        if not keys:
            return
        memo = self._keys
        stride = len(raw) // len(keys)
        whole = stride * len(keys)
        blocks = raw if whole == len(raw) else memoryview(raw)[:whole]
        parents = itertools.chain((parent,), keys)
        # probe_i = key_{i-1} || block_i, concatenated and stored in C.
        probes = map(
            bytes.__add__, parents, map(operator.itemgetter(0), struct.iter_unpack(f"{stride}s", blocks))
        )
        memo.update(zip(probes, keys, strict=True))
        excess = len(memo) - self.capacity
        if excess > 0:
            self._evict(excess)

    def remember_inputs(self, inputs: Sequence[bytes], keys: Sequence[BlockKey]) -> None:
        """Memoize a chain from its digest inputs (as
        :meth:`~kvmesh.core.hashing.BlockHasher.hash_packed_with_inputs` returns them):
        ``keys[i]`` is the key of ``inputs[i]``. The same entries as :meth:`remember`."""
        memo = self._keys
        memo.update(zip(inputs, keys, strict=True))
        excess = len(memo) - self.capacity
        if excess > 0:
            self._evict(excess)

    def _evict(self, n: int) -> None:
        memo = self._keys
        # Past capacity a sixteenth more leaves at once: finding the oldest entries scans the
        # slots freed by earlier evictions, so evicting a few per call would rescan them each time.
        oldest = list(itertools.islice(memo, n + self.capacity // _EVICT_FRACTION))
        for probe in oldest:
            del memo[probe]
        self.num_evicted += len(oldest)
