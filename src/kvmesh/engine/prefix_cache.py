"""Device-tier prefix cache: full blocks of KV keyed by the chained block key, evicted LRU.

Capacity is counted in blocks of ``block_size`` tokens::

    capacity = | pinned blocks (ref > 0) | free cached blocks (ref 0, LRU) | reserved | spare |
                 ^ used by running requests                                  ^ promised to running
                                                                               requests, not cached yet

One ordered map holds every cached block as ``key -> ref count`` (no object per block)::

    oldest ──────────────────────────────────────────────────────────────► newest
    | k7:0 | k3:2 | k9:0 | k1:0 | k4:1 | ...                          | k12:0 |
      ^ evicted first        a block moves to the end whenever its last pin goes

Free blocks sit in the order their last pin went; pinned ones are skipped by eviction (and moved
to the end on the way, where their unpinning would put them anyway), so the free blocks leave in
exactly least-recently-freed order.

A running request holds an :class:`Allocation`: the cached blocks it reads (pinned, so they cannot be
evicted under it) and a reservation for the blocks it will compute. As its blocks fill, ``cache_blocks``
turns reservations into cached blocks; ``free`` unpins them (they become evictable, most-recent last)
and returns what was left of the reservation. Eviction takes the least recently freed block first, and
a chain's blocks are freed tail first so a chain is evicted from its end, keeping its head reusable.

KV (torch mode) is kept per block, in the runner's form (:class:`~kvmesh.engine.runner.KVOps`: numpy
on the CPU, device tensors on a GPU, so a hit never leaves the device). Each block holds its own
contiguous copy, so the memory held is exactly the cached blocks; a hit joins them.

Every change is recorded as a vLLM KV event (medium "GPU"), drained by :meth:`PrefixCache.take_events`.
The engine's block hash on the wire is the first 8 bytes of the :data:`BlockKey`, big-endian.

The cache never sleeps and never reads a clock, so the fleet simulator drives the same class in
virtual time (:meth:`PrefixCache.create_simulated`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvmesh.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace
from kvmesh.core.types import BlockKey, ExternalBlockHash, Medium
from kvmesh.engine.runner import NUMPY_KV, KVArray, KVOps


def engine_block_hash(key: BlockKey) -> int:
    """The u64 an engine publishes for a block: the key's first 8 bytes, big-endian."""
    return int.from_bytes(key[:8], "big")


def prefix_stored_event(
    keys: Sequence[BlockKey], token_ids: Sequence[int], block_size: int, tenant: str, medium: Medium
) -> BlockStored:
    """A BlockStored for the chain of ``keys`` from the root (no parent), as the device tier writes it.

    Args:
        keys: block keys from the prompt's first block.
        token_ids: the prompt (at least ``len(keys) * block_size`` tokens).
        block_size: tokens per block.
        tenant: goes into ``extra_keys`` of the first block, as in the device tier's events.
        medium: the tier that holds the blocks.
    """
    n = len(keys) * block_size
    if len(token_ids) < n:
        raise ValueError(f"{len(keys)} blocks of {block_size} need {n} tokens, got {len(token_ids)}")
    extra_keys: list[object] | None = None
    if tenant:
        extra_keys = [[tenant] if i == 0 else None for i in range(len(keys))]
    return BlockStored(
        block_hashes=[engine_block_hash(k) for k in keys],
        parent_block_hash=None,
        token_ids=list(token_ids[:n]),
        block_size=block_size,
        medium=medium.value,
        extra_keys=extra_keys,
    )


@dataclass(slots=True)
class Allocation:
    """What one running request holds in the cache.

    ``keys`` lists the blocks it pins, in chain order from the first block of its prompt;
    ``num_reserved`` counts blocks promised to it and not yet cached.
    """

    request_id: str
    keys: list[BlockKey] = field(default_factory=list)
    num_reserved: int = 0
    freed: bool = False


class PrefixCache:
    """Block LRU of prompt prefixes with ref-counted pinning and vLLM event output.

    Args:
        capacity_tokens: KV tokens the device holds; rounded down to whole blocks.
        block_size: tokens per block.
        hasher: key chain for the default namespace; tenants get ``namespace.for_tenant(t)``.
        medium: the ``medium`` of published events.
        keep_kv: store each block's KV array (torch mode); ``False`` for emulated and simulated use.
        kv_ops: how to copy and join the runner's KV arrays (numpy by default).
    """

    def __init__(
        self,
        capacity_tokens: int,
        block_size: int = 16,
        hasher: BlockHasher | None = None,
        *,
        medium: str = Medium.GPU.value,
        keep_kv: bool = True,
        kv_ops: KVOps = NUMPY_KV,
    ) -> None:
        if capacity_tokens < block_size:
            raise ValueError(f"capacity_tokens={capacity_tokens} is less than one block of {block_size}")
        self.block_size = block_size
        self.hasher = hasher or BlockHasher(Namespace("default"), block_size)
        if self.hasher.block_size != block_size:
            raise ValueError(f"hasher block_size {self.hasher.block_size} != cache block_size {block_size}")
        self.capacity_blocks = capacity_tokens // block_size
        self.medium = medium
        self.keep_kv = keep_kv
        self.kv_ops = kv_ops
        self._blocks: OrderedDict[BlockKey, int] = OrderedDict()
        """Every cached block's ref count, free blocks in least-recently-freed order."""
        self._num_free = 0
        self._kv: dict[BlockKey, tuple[KVArray, int]] = {}
        """With ``keep_kv``: each block's array and the block's token offset inside it."""
        self._hashers: dict[str, BlockHasher] = {"": self.hasher} if not self.hasher.namespace.tenant else {}
        self.num_reserved = 0
        self.num_evicted = 0
        self._events: list[KVEvent] = []

    @classmethod
    def create_simulated(
        cls, capacity_tokens: int, block_size: int = 16, model: str = "sim", algo: str = "xxh3"
    ) -> PrefixCache:
        """A cache without KV arrays, for emulated engines and the simulator."""
        hasher = BlockHasher(Namespace(model), block_size, HashAlgo(algo))
        return cls(capacity_tokens, block_size, hasher, keep_kv=False)

    # ---------------------------------------------------------------- keys and lookups

    def block_keys(self, tokens: Sequence[int], tenant: str = "") -> list[BlockKey]:
        """Keys of every full block of ``tokens`` in ``tenant``'s namespace."""
        hasher = self._hashers.get(tenant)
        if hasher is None:
            base = self.hasher
            hasher = BlockHasher(base.namespace.for_tenant(tenant), base.block_size, base.algo)
            self._hashers[tenant] = hasher
        return hasher.hash_blocks(tokens)

    def match(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` cached. No side effects."""
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            n += 1
        return n

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def cached_keys(self) -> set[BlockKey]:
        """Every cached block key (pinned or free)."""
        return set(self._blocks)

    def get_kv(self, keys: Sequence[BlockKey]) -> KVArray | None:
        """KV of consecutive cached blocks on the token axis: (L, 2, H, n·block_size, D).

        One block comes back as itself (no copy); more are joined with the runner's ``kv_ops``
        into a new array. Treat the result as read-only: it may be a cached block.

        Returns:
            ``None`` when ``keys`` is empty, a block is missing, or blocks carry no KV.
        """
        bs = self.block_size
        runs: list[tuple[KVArray, int, int]] = []
        for key in keys:
            found = self._kv.get(key)
            if found is None:
                return None
            base, offset = found
            last = runs[-1] if runs else None
            if last is not None and last[0] is base and last[2] == offset:
                runs[-1] = (last[0], last[1], last[2] + bs)
            else:
                runs.append((base, offset, offset + bs))
        if not runs:
            return None
        parts = [base[:, :, :, lo:hi] for base, lo, hi in runs]
        return parts[0] if len(parts) == 1 else self.kv_ops.concat(parts)

    # ---------------------------------------------------------------- accounting

    @property
    def num_cached_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        """Cached blocks nobody pins (evictable)."""
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by running requests: pinned plus reserved."""
        return len(self._blocks) - self._num_free + self.num_reserved

    @property
    def usage(self) -> float:
        """Fraction of capacity held by running requests (vLLM's ``kv_cache_usage_perc``, 0..1)."""
        return self.num_used_blocks / self.capacity_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` more blocks could be reserved (evicting free blocks if needed)."""
        return self.num_used_blocks + num_blocks <= self.capacity_blocks

    # ---------------------------------------------------------------- allocation

    def allocate(
        self, request_id: str, keys: Sequence[BlockKey], num_cached: int, num_new_blocks: int
    ) -> Allocation | None:
        """Pin the first ``num_cached`` of ``keys`` and reserve ``num_new_blocks`` blocks.

        Args:
            request_id: owner, for debugging.
            keys: the request's block keys from its first block.
            num_cached: leading keys to pin; each must be cached (see :meth:`match`).
            num_new_blocks: blocks the request will compute.

        Returns:
            The allocation, or ``None`` when the blocks do not fit (nothing changes then).
        """
        if num_cached > len(keys):
            raise ValueError(f"num_cached={num_cached} exceeds {len(keys)} keys")
        head = keys[:num_cached]
        blocks = self._blocks
        refs = [blocks[k] for k in head]
        newly_pinned = refs.count(0)
        used = len(blocks) - self._num_free + self.num_reserved
        if used + newly_pinned + num_new_blocks > self.capacity_blocks:
            return None
        alloc = Allocation(request_id, list(head), num_new_blocks)
        unfreed = 0
        for key in head:  # _pin, inlined (hot in simulations)
            ref = blocks[key]
            blocks[key] = ref + 1
            if not ref:
                unfreed += 1
        self._num_free -= unfreed
        # _reserve, inlined: the check above guarantees enough free blocks can be evicted.
        excess = len(blocks) + self.num_reserved + num_new_blocks - self.capacity_blocks
        if excess > 0:
            self._make_room(num_new_blocks, reserving=True)
        self.num_reserved += num_new_blocks
        return alloc

    def grow(self, alloc: Allocation, num_blocks: int) -> bool:
        """Reserve ``num_blocks`` more blocks for ``alloc``; ``False`` (and no change) if they do not fit."""
        if not self.can_allocate(num_blocks):
            return False
        self._reserve(num_blocks)
        alloc.num_reserved += num_blocks
        return True

    def shrink(self, alloc: Allocation, num_blocks: int) -> None:
        """Give back ``num_blocks`` of ``alloc``'s reserved, not yet cached blocks.

        Raises:
            ValueError: ``alloc`` reserves fewer blocks.
        """
        if not 0 <= num_blocks <= alloc.num_reserved:
            raise ValueError(
                f"cannot shrink {alloc.request_id} by {num_blocks}: {alloc.num_reserved} reserved"
            )
        alloc.num_reserved -= num_blocks
        self.num_reserved -= num_blocks

    def cache_blocks(
        self,
        alloc: Allocation,
        keys: Sequence[BlockKey],
        token_ids: Sequence[int] | np.ndarray,
        kv: KVArray | None = None,
        kv_start: int = 0,
        tenant: str = "",
    ) -> int:
        """Cache the blocks of ``keys`` past the ones ``alloc`` already pins.

        Args:
            alloc: the owner; its pinned keys must be a prefix of ``keys``.
            keys: block keys from the request's first block.
            token_ids: the request's tokens (at least ``len(keys) * block_size``); only the new
                blocks' tokens are read, into their BlockStored events, and none are kept.
            kv: KV of tokens ``[kv_start, len(keys) * block_size)`` or ``None``, in the runner's
                form. Each new block keeps its own copy (``kv_ops.copy``), nothing of ``kv`` itself.
            kv_start: first token ``kv`` covers; must be ``len(alloc.keys) * block_size`` or less.
            tenant: published in ``extra_keys`` of a chain's first block.

        Returns:
            Blocks added to ``alloc`` (cached now, either new or already there). Fewer than asked
            when the reservation is spent and nothing can be evicted.
        """
        assert not alloc.freed, f"cache_blocks on freed allocation of {alloc.request_id}"
        first = len(alloc.keys)
        # Keys are chained digests: equal keys at the last pinned block mean equal prefixes.
        assert not first or keys[first - 1] == alloc.keys[-1], (
            f"allocation of {alloc.request_id} is not a prefix of keys"
        )
        bs = self.block_size
        blocks = self._blocks
        added = 0
        run_start = first
        for i in range(first, len(keys)):
            key = keys[i]
            if key in blocks:
                self._flush_run(keys, run_start, i, token_ids, tenant)
                run_start = i + 1
                self._pin(key)
                if alloc.num_reserved > 0:
                    alloc.num_reserved -= 1
                    self.num_reserved -= 1
            else:
                if alloc.num_reserved > 0:
                    alloc.num_reserved -= 1
                    self.num_reserved -= 1
                elif not self._make_room(1):
                    break
                if kv is not None and self.keep_kv:
                    lo = i * bs - kv_start
                    assert lo >= 0, f"kv_start={kv_start} is past block {i}"
                    self._kv[key] = (self.kv_ops.copy(kv[:, :, :, lo : lo + bs]), 0)
                blocks[key] = 1
            alloc.keys.append(key)
            added += 1
        self._flush_run(keys, run_start, first + added, token_ids, tenant)
        return added

    def free(self, alloc: Allocation) -> None:
        """Unpin ``alloc``'s blocks (tail first into the LRU) and return its reservation. Idempotent."""
        if alloc.freed:
            return
        alloc.freed = True
        blocks = self._blocks
        to_end = blocks.move_to_end
        for key in reversed(alloc.keys):
            left = blocks[key] - 1  # pinned blocks are never evicted
            assert left >= 0, f"block of {alloc.request_id} unpinned more often than pinned"
            blocks[key] = left
            if not left:
                to_end(key)
                self._num_free += 1
        self.num_reserved -= alloc.num_reserved
        alloc.num_reserved = 0
        assert self.num_reserved >= 0, "reservation count went negative: an allocation was freed twice"

    def reset(self) -> bool:
        """Drop every cached block; refused (``False``) while any block is pinned or reserved."""
        if self.num_used_blocks:
            return False
        self._blocks.clear()
        self._kv.clear()
        self._num_free = 0
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # ---------------------------------------------------------------- internals

    def _pin(self, key: BlockKey) -> None:
        ref = self._blocks[key]
        if ref == 0:
            self._num_free -= 1
        self._blocks[key] = ref + 1

    def _reserve(self, num_blocks: int) -> None:
        self._make_room(num_blocks, reserving=True)
        self.num_reserved += num_blocks

    def _make_room(self, num_blocks: int, reserving: bool = False) -> bool:
        """Evict free blocks until ``num_blocks`` more fit; ``False`` if impossible (nothing evicted)."""
        blocks = self._blocks
        pinned = len(blocks) - self._num_free
        if pinned + self.num_reserved + num_blocks > self.capacity_blocks:
            assert not reserving, "reserve without a capacity check"
            return False
        excess = len(blocks) + self.num_reserved + num_blocks - self.capacity_blocks
        if excess > 0:
            removed: list[ExternalBlockHash] = []
            to_end = blocks.move_to_end
            kv = self._kv
            while len(removed) < excess:
                key = next(iter(blocks))
                if blocks[key]:
                    to_end(key)  # pinned: where its unpinning puts it anyway
                    continue
                del blocks[key]
                if kv:
                    kv.pop(key, None)
                removed.append(engine_block_hash(key))
            self._num_free -= excess
            self.num_evicted += excess
            self._events.append(BlockRemoved(removed, self.medium))
        return True

    def _flush_run(
        self,
        keys: Sequence[BlockKey],
        start: int,
        end: int,
        token_ids: Sequence[int] | np.ndarray,
        tenant: str,
    ) -> None:
        """Publish the new blocks ``keys[start:end]`` (tokens from ``token_ids``)."""
        if start >= end:
            return
        extra_keys: list[object] | None = None
        if tenant:
            extra_keys = [[tenant] if i == 0 else None for i in range(start, end)]
        bs = self.block_size
        part = token_ids[start * bs : end * bs]
        if isinstance(part, np.ndarray):
            tokens = part.tolist()
        elif isinstance(part, list):
            tokens = part  # a slice: already a new list
        else:
            tokens = list(part)
        self._events.append(
            BlockStored(
                block_hashes=[engine_block_hash(k) for k in keys[start:end]],
                parent_block_hash=None if start == 0 else engine_block_hash(keys[start - 1]),
                token_ids=tokens,
                block_size=self.block_size,
                medium=self.medium,
                extra_keys=extra_keys,
            )
        )
