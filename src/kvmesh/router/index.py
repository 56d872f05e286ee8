"""The block index: which pods hold which block, in which tiers.

::

    BlockKey ──► { PodId: MediumSet }        MediumSet = bit set of tiers (GPU|CPU|DISK|SHARED)

Keys are kvmesh's own chained block keys (re-hashed from event tokens by
:mod:`kvmesh.router.ingest`), so a request's keys are computed with the same function and a lookup
is a walk down the chain that stops at the first block nobody holds.

Every backend implements :class:`BlockIndex` (five methods). :class:`InMemoryIndex` is the default:
an LRU-bounded ordered dict mutated only from the event loop (no locks).
:class:`InstrumentedIndex` wraps any backend with Prometheus counters. The Redis backend lives in
:mod:`kvmesh.router.redis_index`; :class:`~kvmesh.router.write_behind.WriteBehindIndex` moves a
remote backend's writes off the event loop.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NewType, Protocol

from prometheus_client import CollectorRegistry, Counter

from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.router.histograms import BucketHistogram

MediumSet = NewType("MediumSet", int)
"""Bit set of the tiers a pod holds one block in."""

EMPTY_MEDIUM_SET = MediumSet(0)

MEDIUM_BITS: dict[Medium, int] = {Medium.GPU: 1, Medium.CPU: 2, Medium.DISK: 4, Medium.SHARED: 8}
ALL_MEDIA = MediumSet(15)
_BEST_FIRST = (Medium.GPU, Medium.CPU, Medium.DISK, Medium.SHARED)
_BEST_OF: list[Medium | None] = [None] * 16
for _mask in range(1, 16):
    _BEST_OF[_mask] = next(m for m in _BEST_FIRST if _mask & MEDIUM_BITS[m])

DEFAULT_INDEX_CAPACITY = 2_000_000

SHARED_TIER_HOLDER = PodId("kvmesh/shared-tier")
"""The index's holder of blocks in the fleet's shared tier (Redis, Valkey, a shared directory).

Any pod may announce such blocks (events with ``medium: SHARED``); every endpoint can load them, so
they are held once, by this pseudo-pod, and :func:`kvmesh.router.prefix.match_prefix_keys` extends
every endpoint's match with them. It is never an endpoint."""


def medium_set(*media: Medium) -> MediumSet:
    """Pack tiers into a :data:`MediumSet`."""
    bits = 0
    for m in media:
        bits |= MEDIUM_BITS[m]
    return MediumSet(bits)


def best_medium(mask: MediumSet) -> Medium:
    """The fastest tier in a non-empty set (GPU, then CPU, DISK, SHARED)."""
    best = _BEST_OF[mask & 15]
    assert best is not None, f"empty medium set {mask} leaked into the index"
    return best


def media_of(mask: MediumSet) -> list[Medium]:
    """Unpack a :data:`MediumSet`, fastest tier first."""
    return [m for m in _BEST_FIRST if mask & MEDIUM_BITS[m]]


Holders = dict[PodId, MediumSet]
"""The pods holding one block and their tiers. Read-only for callers."""


@dataclass(slots=True)
class IndexStats:
    """A snapshot of an index's size and activity."""

    num_keys: int
    num_entries: int
    num_evicted: int
    capacity: int | None
    """Most keys kept; ``None`` for an unbounded index."""
    backend: str


class BlockIndex(Protocol):
    """Where each block lives. All methods are synchronous and idempotent.

    Mutations come from one thread (the event loop); ``lookup`` may run anywhere the backend
    allows (the in-memory one on the same loop, the Redis one on a worker thread).
    """

    def add(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet) -> None:
        """Record that ``pod`` holds every block in ``keys`` in the tiers ``media`` (added to what it had)."""
        ...

    def remove(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet = ALL_MEDIA) -> None:
        """Forget ``pod``'s copies of ``keys`` in the tiers ``media``; unknown keys are ignored."""
        ...

    def lookup(self, keys: Iterable[BlockKey]) -> list[Holders]:
        """Holders of each key in order, stopping before the first key nobody holds.

        Args:
            keys: a prompt's block keys; may be a lazy iterator, which is consumed only as far as
                needed (so callers can hash blocks on demand).

        Returns:
            ``len(result) <= len(keys)``; ``result[i]`` is non-empty.
        """
        ...

    def clear_pod(self, pod: PodId) -> int | None:
        """Drop every block ``pod`` holds (its cache was cleared or its publisher restarted).

        Returns:
            How many (key, pod) entries were dropped; ``None`` from a backend that drops them in
            the background (the number is not known when the call returns).
        """
        ...

    def stats(self) -> IndexStats:
        """Current size and counters."""
        ...


_MAX_SHARED_MAPS = 16_384
"""Holder maps kept for sharing; past this the table starts afresh (maps in use stay valid)."""


class InMemoryIndex:
    """LRU-bounded in-process index.

    Holder maps are immutable and shared: every key whose holders are the same pods with the same
    tiers, in the same order, points to one map, and a change gives the key another map::

        key ──┐
        key ──┼──► {pod-1: GPU}                    a handful of distinct maps for
        key ──┘                                    millions of keys
        key ─────► {pod-1: GPU, shared: SHARED}

    The maps handed out by :meth:`lookup` must therefore stay read-only.

    Args:
        capacity: most keys kept; adding past it evicts the least recently added or looked-up key.
            ``None`` keeps every key and skips the LRU bookkeeping (a plain dict, no order kept):
            for a caller whose engines report every eviction (the fleet simulator), where the index
            can only be as large as the engines' caches together.
        keep: a key for which this says ``True`` is passed over by capacity evictions (moved to
            the recent end) — a client's pin (:class:`~kvmesh.router.pins.PinnedBlocks`). When
            every key left is kept, the index stays over its capacity.
    """

    def __init__(
        self, capacity: int | None = DEFAULT_INDEX_CAPACITY, *, keep: Callable[[BlockKey], bool] | None = None
    ) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"index capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.keep = keep
        self._lru: OrderedDict[BlockKey, Holders] | None = None if capacity is None else OrderedDict()
        self._blocks: dict[BlockKey, Holders] = {} if self._lru is None else self._lru
        self._maps: dict[tuple[tuple[PodId, MediumSet], ...], Holders] = {}
        """The shared holder maps, by their items in order."""
        self._num_entries = 0
        self.num_evicted = 0

    def _shared_map(self, items: tuple[tuple[PodId, MediumSet], ...]) -> Holders:
        """The one map of ``items`` (pod, tiers) in this order."""
        found = self._maps.get(items)
        if found is None:
            if len(self._maps) >= _MAX_SHARED_MAPS:
                self._maps.clear()
            found = self._maps[items] = dict(items)
        return found

    def _with(self, holders: Holders, pod: PodId, media: MediumSet) -> Holders:
        """The map of ``holders`` with ``pod`` at ``media`` (appended if new)."""
        if pod in holders:
            return self._shared_map(tuple((p, media if p == pod else m) for p, m in holders.items()))
        return self._shared_map((*holders.items(), (pod, media)))

    def _without(self, holders: Holders, pod: PodId) -> Holders | None:
        """The map of ``holders`` less ``pod``; ``None`` when nothing is left."""
        items = tuple(item for item in holders.items() if item[0] != pod)
        return self._shared_map(items) if items else None

    def add(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet) -> None:
        blocks = self._blocks
        only = self._shared_map(((pod, media),))
        if blocks.keys().isdisjoint(keys):
            # The common case (freshly stored blocks): every key gets the same map, in C.
            before = len(blocks)
            blocks.update(zip(keys, itertools.repeat(only, len(keys)), strict=True))
            self._num_entries += len(blocks) - before
            if self.capacity is not None and len(blocks) > self.capacity:
                self._evict(len(blocks) - self.capacity)
            return
        touch = None if self._lru is None else self._lru.move_to_end
        added = 0
        for key in keys:
            holders = blocks.get(key)
            if holders is None:
                blocks[key] = only
                added += 1
                continue
            if touch is not None:
                touch(key)
            old = holders.get(pod)
            if old is None:
                blocks[key] = self._with(holders, pod, media)
                added += 1
            elif old | media != old:
                blocks[key] = self._with(holders, pod, MediumSet(old | media))
        self._num_entries += added
        if self.capacity is not None and len(blocks) > self.capacity:
            self._evict(len(blocks) - self.capacity)

    def _evict(self, n: int) -> None:
        lru = self._lru
        assert lru is not None, "eviction from an unbounded index"
        pop = lru.popitem
        keep = self.keep
        if keep is None:
            for _ in range(n):
                _, holders = pop(last=False)
                self._num_entries -= len(holders)
            self.num_evicted += n
            return
        evicted = passed = 0
        while evicted < n and passed < len(lru):
            key, holders = pop(last=False)
            if keep(key):
                lru[key] = holders
                passed += 1
                continue
            self._num_entries -= len(holders)
            evicted += 1
        self.num_evicted += evicted

    def remove(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet = ALL_MEDIA) -> None:
        if len(keys) == 1:
            # One evicted block, as engines announce each: checked here, without the batch's passes.
            holders = self._blocks.get(keys[0])
            if holders is not None and len(holders) == 1 and (held := holders.get(pod)) and not held & ~media:
                del self._blocks[keys[0]]
                self._num_entries -= 1
                return
        elif keys and self._drop_sole_holder(keys, pod, media):
            return
        self._remove_each(keys, pod, media)

    def _remove_each(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet) -> None:
        """:meth:`remove` key by key, whoever else holds them."""
        blocks = self._blocks
        for key in keys:
            holders = blocks.get(key)
            if holders is None:
                continue
            old = holders.get(pod)
            if old is None:
                continue
            left = old & ~media
            if left == old:
                continue
            if left:
                blocks[key] = self._with(holders, pod, MediumSet(left))
                continue
            self._num_entries -= 1
            rest = self._without(holders, pod)
            if rest is None:
                del blocks[key]
            else:
                blocks[key] = rest

    def _drop_sole_holder(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet) -> bool:
        """:meth:`remove` in the common case, at C speed: every key is held by ``pod`` alone, in
        tiers ``media`` covers (an engine's eviction of blocks only it held). ``False``, nothing
        changed, otherwise."""
        blocks = self._blocks
        found = list(map(blocks.get, keys))
        # Holder maps are shared, so the distinct ones are few: check each once.
        for holders in dict(zip(map(id, found), found, strict=True)).values():
            if holders is None or len(holders) != 1:
                return False
            held = holders.get(pod)
            if not held or held & ~media:
                return False
        dropped = list(map(blocks.pop, keys, itertools.repeat(None)))
        # A key named twice is dropped once, as one by one it would be.
        self._num_entries -= len(dropped) - dropped.count(None)
        return True

    def lookup(self, keys: Iterable[BlockKey]) -> list[Holders]:
        # A plain loop: measured faster than map/takewhile/tee pipelines at every prompt length
        # (8 to 128 blocks), and it consumes a lazy key iterator only one key past the match.
        get = self._blocks.get
        touch = None if self._lru is None else self._lru.move_to_end
        out: list[Holders] = []
        append = out.append
        for key in keys:
            holders = get(key)
            if not holders:
                break
            if touch is not None:
                touch(key)
            append(holders)
        return out

    def clear_pod(self, pod: PodId) -> int:
        blocks = self._blocks
        emptied: list[BlockKey] = []
        narrowed: list[tuple[BlockKey, Holders]] = []
        for key, holders in blocks.items():
            if pod in holders:
                rest = self._without(holders, pod)
                if rest is None:
                    emptied.append(key)
                else:
                    narrowed.append((key, rest))
        for key in emptied:
            del blocks[key]
        for key, rest in narrowed:
            blocks[key] = rest  # an existing key: its place in the LRU stays
        self._maps = {items: m for items, m in self._maps.items() if pod not in m}
        dropped = len(emptied) + len(narrowed)
        self._num_entries -= dropped
        return dropped

    def held_by(self, pods: set[PodId]) -> dict[tuple[PodId, MediumSet], list[BlockKey]]:
        """The keys each of ``pods`` holds, by pod and tiers, oldest first (one pass over the index)."""
        out: dict[tuple[PodId, MediumSet], list[BlockKey]] = {}
        if not pods:
            return out
        wanted: dict[int, list[tuple[PodId, MediumSet]]] = {}
        for key, holders in self._blocks.items():
            # Holder maps are shared by many keys: which of them concern ``pods`` is worked out once.
            found = wanted.get(id(holders))
            if found is None:
                found = wanted[id(holders)] = [(p, m) for p, m in holders.items() if p in pods]
            for pod_media in found:
                out.setdefault(pod_media, []).append(key)
        return out

    def stats(self) -> IndexStats:
        return IndexStats(len(self._blocks), self._num_entries, self.num_evicted, self.capacity, "memory")


class InstrumentedIndex:
    """Wraps a :class:`BlockIndex` with Prometheus metrics on its own registry.

    Metrics: ``kvmesh_router_index_ops_total{op}``, ``kvmesh_router_index_keys_total{op}`` and
    ``kvmesh_router_index_lookup_seconds``.
    """

    def __init__(self, inner: BlockIndex, registry: CollectorRegistry | None = None) -> None:
        self.inner = inner
        self.registry = registry if registry is not None else CollectorRegistry()
        self._ops = Counter("kvmesh_router_index_ops", "Index operations", ["op"], registry=self.registry)
        self._keys = Counter(
            "kvmesh_router_index_keys", "Keys passed to index operations", ["op"], registry=self.registry
        )
        # Observed on every routed request: the cheaper histogram (one lock, bisect).
        self._lookup_seconds = BucketHistogram(
            "kvmesh_router_index_lookup_seconds",
            "Index lookup latency",
            (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
        )
        self.registry.register(self._lookup_seconds)
        self._add_ops, self._add_keys = self._ops.labels("add"), self._keys.labels("add")
        self._rm_ops, self._rm_keys = self._ops.labels("remove"), self._keys.labels("remove")
        self._lk_ops, self._lk_keys = self._ops.labels("lookup"), self._keys.labels("lookup")
        self._clear_ops = self._ops.labels("clear_pod")

    def add(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet) -> None:
        self._add_ops.inc()
        self._add_keys.inc(len(keys))
        self.inner.add(keys, pod, media)

    def remove(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet = ALL_MEDIA) -> None:
        self._rm_ops.inc()
        self._rm_keys.inc(len(keys))
        self.inner.remove(keys, pod, media)

    def lookup(self, keys: Iterable[BlockKey]) -> list[Holders]:
        start = time.perf_counter()
        result = self.inner.lookup(keys)
        self._lookup_seconds.observe(time.perf_counter() - start)
        self._lk_ops.inc()
        self._lk_keys.inc(len(result))
        return result

    def clear_pod(self, pod: PodId) -> int | None:
        self._clear_ops.inc()
        return self.inner.clear_pod(pod)

    def stats(self) -> IndexStats:
        return self.inner.stats()


def _conforms(memory: InMemoryIndex, instrumented: InstrumentedIndex) -> tuple[BlockIndex, BlockIndex]:
    """Lets mypy check that each implementation satisfies :class:`BlockIndex`."""
    return memory, instrumented
