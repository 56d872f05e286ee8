"""The engine's traffic with the KV store: prefixes loaded before a request queues, prompts written after.

A request's prefix is looked up (and fetched) before it joins the queue, so the scheduling loop never
waits on the store. A prompt's new full chunks are written once per request, after its first token is
out (off the TTFT path): the step queues the request, the loop exports its KV after streaming the
token, and the write runs in the background. A request released while its write is queued keeps its
runner state until the export is done.

When a write reaches a shared tier (Redis/Valkey, shared directory), a ``BlockStored`` with medium
``"SHARED"`` announces the prompt's blocks from the root through the run of chunks that tier holds:
every endpoint of the fleet can load them. The tiers only this engine reads (RAM, local disk) report
what they store and evict, and :class:`~kvmesh.engine.local_tiers.LocalTierAnnouncer` turns that into
``"CPU"``/``"DISK"`` events for the prompts' device blocks, so the router prices this engine at its
load time for a prefix its device tier evicted. The events wait in :meth:`StoreSync.take_events` and
the engine is woken to publish them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmesh.core.events import BlockStored, KVEvent
from kvmesh.core.shared_writes import PromptBlocks, SharedWriteAnnouncer
from kvmesh.core.tenancy import Role
from kvmesh.core.types import BlockKey
from kvmesh.engine.local_tiers import LocalTierAnnouncer
from kvmesh.engine.prefix_cache import PrefixCache, engine_block_hash
from kvmesh.engine.request import EngineRequest, EngineStats
from kvmesh.engine.runner import NUMPY_KV, KVArray, ModelRunner, Sequence
from kvmesh.engine.store_connector import (
    LoadedPrefix,
    NullPrefixStore,
    PrefixStore,
    PromptWrite,
    StoreWritten,
)

if TYPE_CHECKING:
    from kvmesh.store.keys import StoreKey

logger = logging.getLogger(__name__)


def shared_prompt_blocks(keys: list[BlockKey], block_size: int, tenant: str) -> PromptBlocks:
    """The engine's names for a prompt's blocks in SHARED events: the hashes and tenant (as the
    cache salt, vLLM's place for it) its device tier publishes the blocks under."""
    return PromptBlocks(tuple(engine_block_hash(k) for k in keys), block_size, cache_salt=tenant or None)


class StoreSync:
    """Loads prefixes from and writes prompts to a :class:`PrefixStore` for one engine.

    Args:
        store: the store (``None`` or :class:`NullPrefixStore`: no store traffic at all).
        runner: where prompt KV is exported from, and whose per-sequence state is freed.
        cache: the device tier (a prefix it already holds is not fetched again).
        stats: the engine's counters (store reads and writes).
        write: write prompts to the store (reads happen either way).
        announce_shared: announce prompts written to a shared tier as ``"SHARED"`` events.
        announce_local: announce what the tiers only this engine reads (RAM, local disk) store and
            evict as ``"CPU"``/``"DISK"`` events.
        wake: called when such an event is waiting in :meth:`take_events` (it may come from a
            background write while the engine is idle).
    """

    def __init__(
        self,
        store: PrefixStore | None,
        runner: ModelRunner,
        cache: PrefixCache,
        stats: EngineStats,
        *,
        write: bool = True,
        announce_shared: bool = True,
        announce_local: bool = True,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.store: PrefixStore = store or NullPrefixStore()
        self.enabled = store is not None and not isinstance(store, NullPrefixStore)
        self.runner = runner
        self.cache = cache
        self.stats = stats
        self.write = write
        self.announce_shared = announce_shared
        self._wake = wake
        self._tasks: set[asyncio.Task[None]] = set()
        self._queued: list[EngineRequest] = []
        self._deferred_free: list[Sequence] = []
        self._shared = SharedWriteAnnouncer(BlockStored, wake=wake)
        self.local: LocalTierAnnouncer | None = None
        """Announces the local tiers' chunks; ``None`` when off or when the store has no local tier."""
        if self.enabled and announce_local:
            announcer = LocalTierAnnouncer(cache, self.store.chunk_size, wake=wake)
            if announcer.listen(self.store):
                self.local = announcer

    # ---------------------------------------------------------------- reads

    def cacheable_tokens(self, req: EngineRequest) -> int:
        """Prompt tokens a cache hit may cover: never the block holding the last prompt token."""
        bs = self.cache.block_size
        return (req.prompt_len - 1) // bs * bs

    def store_keys(self, req: EngineRequest) -> list[StoreKey]:
        """The store keys of ``req``'s full prompt chunks, hashed on first use and kept on it."""
        keys = req.store_keys
        if keys is None:
            keys = req.store_keys = self.store.store_keys(req.seq.token_ids[: req.prompt_len], req.tenant)
        return keys

    async def load_prefix(self, req: EngineRequest) -> None:
        """Fetch the longest stored prefix that beats the device tier into ``req.loaded``: one
        store read, which reads no chunk unless the store holds more than the device tier."""
        if not self.enabled:
            return
        bs = self.cache.block_size
        limit_tokens = self.cacheable_tokens(req)
        local_tokens = self.cache.match(req.keys[: limit_tokens // bs]) * bs
        if limit_tokens < self.store.chunk_size or local_tokens >= limit_tokens:
            return
        probe = req.seq.token_ids[:limit_tokens]
        start = time.perf_counter()
        try:
            keys = self.store_keys(req)
            if self.local is not None:
                # The read may copy chunks into a local tier (promotion): they are this prompt's.
                self.local.expect(probe, req.keys, req.tenant, keys)
            loaded = await self.store.retrieve(probe, req.tenant, keys, beyond=local_tokens)
        except Exception:
            # The store turns tier failures into misses; anything escaping it is a store bug. It is
            # logged loudly and the request recomputes instead of failing.
            self.stats.num_store_read_failures += 1
            req.store_fault = True
            logger.exception("store read failed; recomputing")
            return
        if loaded is not None and loaded.held_tokens > max(loaded.num_tokens, local_tokens):
            # The tiers said they held more than they served: a chunk failed its checks or a tier
            # failed between the existence check and the read.
            req.store_fault = True
        if loaded is None or loaded.num_tokens <= local_tokens:
            return
        num_tokens = min(loaded.num_tokens, limit_tokens)
        num_tokens -= num_tokens % bs
        parts = loaded.parts if loaded.kv is None else (loaded.kv,)
        if self.runner.kv_ops is NUMPY_KV and len(parts) > 1:
            # Host memory: joined now, off the event loop (a long prompt is gigabytes).
            try:
                parts = (await asyncio.to_thread(NUMPY_KV.join_host, parts),)
            except Exception:
                self.stats.num_store_read_failures += 1
                req.store_fault = True
                logger.exception("joining a loaded prefix failed; recomputing")
                return
        # Device memory is taken at admission (:meth:`to_runner`), not while the request waits.
        req.loaded = LoadedPrefix(num_tokens, None, loaded.tier, parts)
        self.stats.num_store_loads += 1
        self.stats.store_fetch_seconds += time.perf_counter() - start

    def to_runner(self, loaded: LoadedPrefix) -> KVArray | None:
        """A loaded prefix in the runner's form, its first ``num_tokens`` tokens; ``None`` (counted,
        logged: the request recomputes) when the copy fails, e.g. the device is out of memory.

        Called at admission, on the event loop: a GPU copy blocks it for the transfer, which a
        request waiting in the queue must not hold device memory for.
        """
        ops = self.runner.kv_ops
        parts = loaded.parts
        start = time.perf_counter()
        try:
            kv = parts[0] if len(parts) == 1 and ops is NUMPY_KV else ops.join_host(parts)
        except Exception:
            self.stats.num_store_read_failures += 1
            logger.exception("moving a loaded prefix to the runner failed; recomputing")
            return None
        self.stats.store_to_runner_seconds += time.perf_counter() - start
        return kv if kv.shape[3] == loaded.num_tokens else kv[:, :, :, : loaded.num_tokens]

    # ---------------------------------------------------------------- writes

    def queue_write(self, req: EngineRequest) -> None:
        """Queue the prompt's new full chunks (once per request; call when its first token is sampled)."""
        if not self.enabled or not self.write or req.store_queued:
            return
        req.store_queued = True
        n = (req.prompt_len // self.store.chunk_size) * self.store.chunk_size
        # A cached prefix this long was written when it was first computed (or came from the store);
        # a prompt to pin is written anyway, to every tier that lacks it.
        if n == 0 or (n <= req.num_cached_tokens and req.pin_ttl_s is None):
            return
        req.store_done = asyncio.get_running_loop().create_future()
        self._queued.append(req)

    def free_runner_state(self, req: EngineRequest) -> None:
        """Free ``req``'s runner state now, or after its queued prompt KV has been exported."""
        if req in self._queued:
            self._deferred_free.append(req.seq)
        else:
            self.runner.free(req.seq)

    def flush(self) -> None:
        """Export queued prompts' KV into background writes; then free deferred runner state."""
        queued, self._queued = self._queued, []
        for req in queued:
            n = (req.prompt_len // self.store.chunk_size) * self.store.chunk_size
            done = req.store_done
            assert done is not None, "queued store write without its future"
            try:
                chunk_keys = self.store_keys(req)[: n // self.store.chunk_size]
                # The device tier keeps the prompt's blocks (their KV left the runner once, when
                # they were computed or loaded); the runner is asked only when it holds no KV.
                kv = self.cache.get_kv(req.keys[: n // self.cache.block_size]) if self.cache.keep_kv else None
                if kv is None:
                    kv = self.runner.export_kv(req.seq, 0, n)
            except Exception:
                # e.g. no device memory for the copy: the prompt is not written, nothing else fails
                self.stats.num_store_write_failures += 1
                logger.exception("exporting a prompt's KV for the store failed")
                kv = None
            if kv is None:
                done.set_result(None)
                continue
            tokens = req.seq.token_ids[:n]
            keys = req.keys[: n // self.cache.block_size]
            announce = None
            if self.announce_shared:
                announce = self._shared_announcer(keys, tokens, req.tenant)
            skip = 0 if req.pin_ttl_s is not None else req.num_cached_tokens
            task = asyncio.create_task(
                self._write(
                    tokens,
                    keys,
                    chunk_keys,
                    req.tenant,
                    kv,
                    skip,
                    req.role,
                    done,
                    announce,
                    pin_for=req,
                )
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        deferred, self._deferred_free = self._deferred_free, []
        for seq in deferred:
            self.runner.free(seq)

    async def _write(
        self,
        tokens: list[int],
        keys: list[BlockKey],
        chunk_keys: list[StoreKey],
        tenant: str,
        kv: KVArray,
        skip: int,
        role: Role,
        done: asyncio.Future[None],
        on_written: StoreWritten | None,
        *,
        pin_for: EngineRequest | None = None,
    ) -> None:
        pin_ttl_s = None if pin_for is None else pin_for.pin_ttl_s
        try:
            ops = self.runner.kv_ops
            # Out of device memory off the event loop (the copy waits for the step in flight).
            host = kv if ops is NUMPY_KV else await asyncio.to_thread(ops.to_host, kv)
            if self.local is not None:
                self.local.expect(tokens, keys, tenant, chunk_keys)
            write = PromptWrite(tokens, tenant, host, skip, on_written, pin_ttl_s is not None, chunk_keys)
            await self.store.store(write)
            if pin_for is not None and pin_ttl_s is not None:
                pin_for.pin_results = await self.store.pin(tokens, tenant, pin_ttl_s)
            if role is Role.PREFILL:
                # The decode side reads this KV next: it must have reached every tier.
                await self.store.drain()
            self.stats.num_store_writes += 1
        except Exception:
            # The store's contract is to absorb tier failures; anything that still escapes is a bug
            # there, logged loudly, and must not take the engine down.
            self.stats.num_store_write_failures += 1
            logger.exception("store write failed")
        finally:
            if not done.done():
                done.set_result(None)

    def _shared_announcer(self, keys: list[BlockKey], tokens: list[int], tenant: str) -> StoreWritten:
        """The ``on_written`` of one prompt's write: a SHARED event whenever a shared tier holds more
        of the prompt than announced so far, named as the device tier names the blocks.

        Only shared tiers are announced here; the local CPU and disk tiers report what they store
        and evict themselves (:attr:`local`). A shared tier's own evictions (TTL, maxmemory) are not
        announced: a stale SHARED entry costs the engine it is routed to one store miss, and that
        engine recomputes.
        """
        return self._shared.on_written(shared_prompt_blocks(keys, self.cache.block_size, tenant), tokens)

    def take_events(self) -> list[KVEvent]:
        """SHARED, CPU and DISK events since the last call, oldest first.

        Call right after taking the device tier's events, and publish these after those: whether a
        local tier's event needs the blocks' tokens depends on what the device tier announced.
        """
        events: list[KVEvent] = self._shared.take_events()
        if self.local is not None:
            events += self.local.take_events()
        return events

    def device_cleared(self) -> None:
        """The device tier published ``AllBlocksCleared``: the router forgot this engine's local
        tiers' blocks too."""
        if self.local is not None:
            self.local.forget()

    async def wait(self, *, drain: bool = True) -> None:
        """Wait until the writes started so far reached every store tier (``drain=False``: until
        they were handed to the store, which writes its RAM tier inline and queues the others)."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if drain:
            await self.store.drain()

    async def close(self) -> None:
        """Wait for the writes in flight (the store itself is closed by its owner)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
