"""Lower KV tiers of the simulated fleet: a per-replica CPU tier and a fleet-wide shared store.

Both are the engine's :class:`~kvmesh.engine.prefix_cache.PrefixCache` used at store-chunk
granularity (one "block" = one chunk of ``chunk_size`` tokens, keyed by the device-tier key at the
chunk's last block, as :meth:`kvmesh.core.hashing.BlockHasher.chunk_keys` defines store keys). So a
lower-tier lookup is the store's prefix lookup: consecutive chunks from the start, stopping at the
first chunk no tier holds.

Reads from the shared tier cross the store's NIC and the replica's NIC (:mod:`kvmesh.sim.network`),
so their time includes queueing behind other transfers; writes (write-through after a prefill, off
the request's path) load the opposite directions. CPU reads cost ``CostModel.kv_load_time(n, "CPU")``.

The CPU tier announces what it holds as vLLM's CPU offloading does: a BlockStored without tokens,
``medium: CPU``, naming device-tier blocks the replica announced before (so the router adds the CPU
tier to blocks it knows), and a BlockRemoved ``medium: CPU`` when a chunk is evicted. The router then
prices a session spilled to a replica's CPU tier at its load time there, not as a miss.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.core.events import BlockRemoved, BlockStored, KVEvent
from kvmesh.core.tier_scan import PrefixScan
from kvmesh.core.types import BlockKey, ExternalBlockHash, Medium
from kvmesh.engine.cost_model import CostModel
from kvmesh.engine.prefix_cache import PrefixCache, engine_block_hash
from kvmesh.sim.network import Link, path_transfer


def _chunk_cache(capacity_tokens: int, chunk_size: int, medium: Medium) -> PrefixCache:
    cache = PrefixCache.create_simulated(capacity_tokens, chunk_size)
    cache.medium = medium.value
    return cache


def _insert(
    cache: PrefixCache, owner: str, keys: list[BlockKey], tokens: Sequence[int]
) -> tuple[int, list[KVEvent]]:
    """Cache ``keys`` (chunk keys from the prompt's start) as most recently used.

    Returns:
        Chunks added (the ``n`` keys after the ones the cache held) and the cache's events.
    """
    keys = keys[: cache.capacity_blocks]
    have = cache.match(keys)
    if have:
        _touch(cache, owner, keys[:have])
    if have == len(keys):
        return 0, []
    alloc = cache.allocate(owner, keys, have, len(keys) - have)
    if alloc is None:
        return 0, []
    added = cache.cache_blocks(alloc, keys, tokens)
    cache.free(alloc)
    return added, cache.take_events()


def _touch(cache: PrefixCache, owner: str, keys: list[BlockKey]) -> None:
    alloc = cache.allocate(owner, keys, len(keys), 0)
    if alloc is not None:
        cache.free(alloc)


@dataclass(slots=True)
class SharedStore:
    """The fleet-wide shared tier (Redis/Valkey or a shared directory).

    Args:
        capacity_tokens: KV tokens it holds before evicting LRU chunks.
        chunk_size: tokens per chunk.
        store_gbps: the store's own NIC (each direction); ``None`` = never the bottleneck.
        latency_s: per transfer (request round trip + first byte).
    """

    capacity_tokens: int
    chunk_size: int
    store_gbps: float | None = None
    latency_s: float = 1.5e-3
    cache: PrefixCache = field(init=False)
    rx: Link = field(init=False)
    tx: Link = field(init=False)

    def __post_init__(self) -> None:
        self.cache = _chunk_cache(self.capacity_tokens, self.chunk_size, Medium.SHARED)
        rate = math.inf if self.store_gbps is None else self.store_gbps * 1e9 / 8
        self.rx = Link(rate, 0.0)
        self.tx = Link(rate, 0.0)


@dataclass(slots=True)
class TierStats:
    """Per-replica lower-tier traffic."""

    cpu_hit_tokens: int = 0
    shared_hit_tokens: int = 0
    shared_read_bytes: int = 0
    shared_write_bytes: int = 0
    cpu_write_chunks: int = 0
    shared_write_chunks: int = 0


class TierStack:
    """The tiers below one replica's device cache.

    Args:
        cost: the replica's cost model (KV bytes per token, CPU link).
        block_size: device-tier block size.
        chunk_size: store chunk size, a multiple of ``block_size``.
        cpu_capacity_tokens: local CPU tier size; ``0`` = no CPU tier.
        shared: the fleet's shared store, or ``None``.
        net_gbps: this replica's NIC (each direction) towards the shared store.
        name: owner label for cache allocations.
    """

    def __init__(
        self,
        cost: CostModel,
        block_size: int,
        chunk_size: int,
        cpu_capacity_tokens: int = 0,
        shared: SharedStore | None = None,
        net_gbps: float = 100.0,
        name: str = "replica",
    ) -> None:
        if chunk_size % block_size:
            raise ValueError(f"chunk_size={chunk_size} must be a multiple of block_size={block_size}")
        if shared is not None and shared.chunk_size != chunk_size:
            raise ValueError(f"shared store chunk_size={shared.chunk_size} != {chunk_size}")
        self.cost = cost
        self.name = name
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // block_size
        self.kv_bytes_per_token = cost.model.kv_bytes_per_token
        self.cpu = _chunk_cache(cpu_capacity_tokens, chunk_size, Medium.CPU) if cpu_capacity_tokens else None
        self.shared = shared
        rate = net_gbps * 1e9 / 8
        latency = shared.latency_s if shared is not None else 0.0
        self.rx = Link(rate, latency)
        self.tx = Link(rate, latency)
        self.stats = TierStats()
        self.enabled = self.cpu is not None or shared is not None
        self._events: list[KVEvent] = []
        self._cpu_blocks: dict[int, array[int]] = {}
        """Engine hash of each CPU chunk's key → engine hashes of its device blocks (u64s in one
        array: a quarter of the memory of a list of ints)."""

    def take_events(self) -> list[KVEvent]:
        """The CPU tier's announcements since the last call (for the router, as the device tier's)."""
        events, self._events = self._events, []
        return events

    def _announce_cpu(self, block_keys: list[BlockKey], events: list[KVEvent], have: int, added: int) -> None:
        """Turn the CPU chunk cache's own events into device-block announcements: evicted chunks'
        blocks leave the CPU tier, chunks ``[have, have + added)`` of the prompt join it."""
        per = self.blocks_per_chunk
        held = self._cpu_blocks
        out = self._events
        for ev in events:
            if isinstance(ev, BlockRemoved):
                gone: list[ExternalBlockHash] = []
                for h in ev.block_hashes:
                    blocks = held.pop(h, None) if isinstance(h, int) else None
                    if blocks is not None:
                        gone.extend(blocks)
                if gone:
                    out.append(BlockRemoved(block_hashes=gone, medium=Medium.CPU.value))
        if added <= 0:
            return
        stored: list[ExternalBlockHash] = []
        for c in range(have, have + added):
            chunk_blocks = array("Q", map(engine_block_hash, block_keys[c * per : (c + 1) * per]))
            held[chunk_blocks[-1]] = chunk_blocks
            stored.extend(chunk_blocks)
        out.append(
            BlockStored(
                block_hashes=stored,
                parent_block_hash=None,
                token_ids=[],
                block_size=self.chunk_size // per,
                medium=Medium.CPU.value,
            )
        )

    def chunk_keys(self, block_keys: list[BlockKey]) -> list[BlockKey]:
        """Store chunk keys of a prompt from its device-tier block keys."""
        return block_keys[self.blocks_per_chunk - 1 :: self.blocks_per_chunk]

    def load_prefix(
        self, block_keys: list[BlockKey], have_tokens: int, max_tokens: int, now: float
    ) -> tuple[int, int, float]:
        """Pull the prompt's prefix beyond ``have_tokens`` from the lower tiers.

        Args:
            block_keys: the prompt's device-tier block keys.
            have_tokens: prefix tokens already in device memory.
            max_tokens: most prefix tokens worth loading (the last prompt token is always computed).
            now: virtual time of the request.

        Returns:
            ``(cpu_tokens, shared_tokens, ready_at)``: tokens loaded from each tier beyond
            ``have_tokens`` and when the last of them is in device memory.
        """
        chunks = self.chunk_keys(block_keys)
        size = self.chunk_size
        limit = min(len(chunks), max_tokens // size)
        first = have_tokens // size
        if limit <= first:
            return 0, 0, now
        cpu, shared = self.cpu, self.shared
        # The store's own pass (one question per tier, chunks from their fastest holder); the
        # chunks the device tier holds are known held, as the engine's ``beyond`` treats them.
        scan = PrefixScan(limit)
        scan.record(-1, range(first), [True] * first)
        for t, tier in enumerate((cpu, None if shared is None else shared.cache)):
            if tier is not None:
                asked = scan.unresolved()
                scan.record(t, asked, [chunks[i] in tier for i in asked])
        cpu_served, shared_served = scan.served_by(0, first), scan.served_by(1, first)
        cpu_hits = [chunks[i] for i in cpu_served]
        cpu_tokens = self._gain(cpu_served, have_tokens)
        shared_tokens = self._gain(shared_served, have_tokens)
        ready = now
        if cpu_tokens:
            assert cpu is not None
            _touch(cpu, self.name, cpu_hits)
            ready = now + self.cost.kv_load_time(cpu_tokens, "CPU")
            self.stats.cpu_hit_tokens += cpu_tokens
        if shared_tokens:
            assert shared is not None
            num_bytes = shared_tokens * self.kv_bytes_per_token
            ready = max(ready, path_transfer(now, num_bytes, shared.tx, self.rx))
            self.stats.shared_hit_tokens += shared_tokens
            self.stats.shared_read_bytes += num_bytes
        return cpu_tokens, shared_tokens, ready

    def _gain(self, served: list[int], have_tokens: int) -> int:
        """Tokens beyond ``have_tokens`` that the chunks ``served`` add."""
        size = self.chunk_size
        return sum((i + 1) * size - max(have_tokens, i * size) for i in served)

    def write_prefix(self, block_keys: list[BlockKey], tokens: Sequence[int], now: float) -> int:
        """Write-through of a computed prompt's full chunks (asynchronous: loads links, delays nothing).

        Returns:
            Prompt tokens the shared tier holds from the start once it took new chunks of this
            prompt (what the engine announces to the router); 0 when it took none.
        """
        chunks = self.chunk_keys(block_keys)
        if not chunks:
            return 0
        if self.cpu is not None:
            have = self.cpu.match(chunks)
            added, events = _insert(self.cpu, self.name, chunks, tokens)
            self.stats.cpu_write_chunks += added
            self._announce_cpu(block_keys, events, have, added)
        shared = self.shared
        if shared is None:
            return 0
        added, _ = _insert(shared.cache, self.name, chunks, tokens)
        if not added:
            return 0
        num_bytes = added * self.chunk_size * self.kv_bytes_per_token
        path_transfer(now, num_bytes, self.tx, shared.rx)
        self.stats.shared_write_chunks += added
        self.stats.shared_write_bytes += num_bytes
        return shared.cache.match(chunks) * self.chunk_size
