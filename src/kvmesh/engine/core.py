"""The engine core: the step scheduler driven on a model runner by one asyncio task.

One task owns all scheduling state (no locks). Each iteration:

1. reap cancelled requests (free their runner state, unpin their blocks);
2. ask the :class:`~kvmesh.engine.step_scheduler.StepScheduler` for the next step (the same policy
   the fleet simulator runs in virtual time);
3. run it on the :class:`ModelRunner`, append sampled tokens, cache newly full blocks, stream outputs;
4. publish the cache's KV events, then hand queued prompts to the store (:mod:`.store_sync`).

Events of background store writes (prompts a shared tier now holds, chunks the engine's own RAM
and disk tiers stored or evicted) wake the loop, which publishes them even when no step is running.

A request's prefix comes from the longest of its blocks in the device-tier cache or the store
(fetched before the request queues, so the loop never waits on the store).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from kvmesh.core.event_transport import EventPublisher, NullEventPublisher
from kvmesh.core.events import AllBlocksCleared
from kvmesh.core.tasks import cancel_and_wait
from kvmesh.core.tenancy import Role
from kvmesh.core.types import Medium
from kvmesh.engine.prefix_cache import PrefixCache
from kvmesh.engine.request import EngineRequest, EngineStats, RequestOutput
from kvmesh.engine.runner import ModelRunner, PrefillChunk, StepOutput, StepPlan
from kvmesh.engine.step_scheduler import BatchLimits, Release, SchedulerOutput, StepScheduler
from kvmesh.engine.store_connector import PrefixStore
from kvmesh.engine.store_sync import StoreSync

logger = logging.getLogger(__name__)

__all__ = ["EngineCore", "EngineRequest", "RequestOutput", "Role", "SchedulerConfig"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batching limits and store traffic."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    write_to_store: bool = True
    announce_shared_writes: bool = True
    """Publish a ``"SHARED"`` BlockStored when a prompt's chunks reach a shared store tier."""
    announce_local_tiers: bool = True
    """Publish ``"CPU"``/``"DISK"`` BlockStored and BlockRemoved as the store tiers only this engine
    reads (RAM, local disk) store and evict a prompt's chunks."""


class EngineCore:
    """Schedules requests onto a runner, with the device-tier cache and an optional store.

    Args:
        runner: executes steps.
        cache: the device-tier prefix cache (its hasher carries the model namespace).
        config: batching limits.
        store: the KV store (``NullPrefixStore`` when none).
        publisher: where KV events go.
    """

    def __init__(
        self,
        runner: ModelRunner,
        cache: PrefixCache,
        config: SchedulerConfig | None = None,
        *,
        store: PrefixStore | None = None,
        publisher: EventPublisher | None = None,
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.config = config or SchedulerConfig()
        self.publisher: EventPublisher = publisher or NullEventPublisher()
        self.stats = EngineStats()
        limits = BatchLimits(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.scheduler: StepScheduler[EngineRequest] = StepScheduler(cache, limits, self)
        self._wake = asyncio.Event()
        self._prefilled: list[EngineRequest] = []
        """Requests whose prefill finished in the step being applied (:meth:`on_prefill_done`)."""
        self.store_sync = StoreSync(
            store,
            runner,
            cache,
            self.stats,
            write=self.config.write_to_store,
            announce_shared=self.config.announce_shared_writes,
            announce_local=self.config.announce_local_tiers,
            wake=self._wake.set,
        )
        self._requests: dict[str, EngineRequest] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def store(self) -> PrefixStore:
        return self.store_sync.store

    @property
    def has_store(self) -> bool:
        return self.store_sync.enabled

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the scheduling loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="kvmesh-engine-loop")
            self._task.add_done_callback(self._on_loop_exit)

    async def aclose(self) -> None:
        """Stop the loop, abort what is left, wait for pending store writes, flush events."""
        self._closing = True
        self._wake.set()
        await cancel_and_wait([self._task])
        self._task = None
        for req in list(self._requests.values()):
            self.scheduler.abort(req)
            self._finish(req, "abort")
        await self.store_sync.close()
        self._publish_events()

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        logger.error("engine loop crashed; failing every request", exc_info=task.exception())
        self._closing = True
        for req in list(self._requests.values()):
            self._finish(req, "error")

    async def wait_store_writes(self) -> None:
        """Wait until the background store writes started so far reached every store tier."""
        await self.store_sync.wait()

    # ---------------------------------------------------------------- requests

    async def add_request(self, req: EngineRequest) -> EngineRequest:
        """Queue ``req`` after looking its prefix up in the store.

        Raises:
            ValueError: the request id is in use or the prompt is empty.
        """
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if not req.seq.token_ids:
            raise ValueError("prompt must hold at least one token")
        if self._closing:
            raise RuntimeError("engine is shutting down")
        self._requests[req.request_id] = req
        room = self.runner.info.max_model_len - req.prompt_len
        req.max_output = max(1, min(req.max_output, room))
        try:
            req.keys = self.cache.block_keys(req.seq.token_ids, req.tenant)
            await self.store_sync.load_prefix(req)
        except BaseException:
            # Cancelled while the store answered (the client left), or bad token ids.
            self._requests.pop(req.request_id, None)
            raise
        if req.aborted:
            self._finish(req, "abort")
            return req
        self.scheduler.add(req)
        self._wake.set()
        return req

    def abort(self, request_id: str) -> None:
        """Cancel a request; its slot and blocks are released before the next step. Idempotent."""
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return
        req.aborted = True
        if req.alloc is None and self.scheduler.abort(req):
            self._finish(req, "abort")
        self._wake.set()

    # ---------------------------------------------------------------- loop

    async def _loop(self) -> None:
        sched = self.scheduler
        while not self._closing:
            for req in [r for r in sched.running if r.aborted]:
                sched.abort(req)
                self._finish(req, "abort")
            out = sched.schedule()
            for req in out.rejected:
                logger.warning("request %s does not fit in the KV cache; failing it", req.request_id)
                self._finish(req, "error")
            if out.empty:
                self._publish_events()
                self._wake.clear()
                await self._wake.wait()
                continue
            plan, decoding = self._step_plan(out)
            try:
                result = await self.runner.execute(plan)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("runner failed a step; failing its requests")
                for req in [r for r, _, _ in out.prefills] + decoding:
                    if sched.abort(req):
                        self._finish(req, "error")
                continue
            self.stats.num_steps += 1
            self._process(out, decoding, result)
            self._publish_events()
            # Let the server write streamed tokens before the store export copies KV.
            await asyncio.sleep(0)
            self.store_sync.flush()

    def _step_plan(self, out: SchedulerOutput[EngineRequest]) -> tuple[StepPlan, list[EngineRequest]]:
        plan = StepPlan()
        bs = self.cache.block_size
        for req, start, end in out.prefills:
            chunk = PrefillChunk(req.seq, start, end)
            if start > 0 and req.seq.num_computed_tokens == 0:
                # The runner holds nothing for it yet: hand over the cached prefix's KV.
                chunk.cached_tier = req.cached_tier
                if req.prefix_kv is not None and req.prefix_kv.shape[3] == start:
                    chunk.cached_kv = req.prefix_kv
                else:
                    chunk.cached_kv = self.cache.get_kv(req.keys[: start // bs])
                req.prefix_kv = None
            plan.prefills.append(chunk)
        decoding = self.scheduler.decoding_requests()
        plan.decodes = [r.seq for r in decoding]
        return plan, decoding

    def _process(
        self, out: SchedulerOutput[EngineRequest], decoding: list[EngineRequest], result: StepOutput
    ) -> None:
        now = time.monotonic()
        sampled = result.sampled
        self.scheduler.update(out)
        prefilled, self._prefilled = self._prefilled, []
        for req in prefilled + decoding:
            token = sampled.get(req.request_id)
            if token is not None and not req.finished:
                self._append_token(req, token, now)

    def _append_token(self, req: EngineRequest, token: int, now: float) -> None:
        seq = req.seq
        seq.token_ids.append(token)
        req.num_output_tokens += 1
        self.stats.num_generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        if req.last_token_time is not None:
            req.token_gaps.append(now - req.last_token_time)
        req.last_token_time = now
        reason = self._stop_reason(req, token)
        req._emit(RequestOutput([token]))
        if reason is None and req.alloc is None:
            reason = "length"  # the scheduler ended it at its length
        if reason is not None:
            self.scheduler.finish(req)
            self._finish(req, reason)

    def _stop_reason(self, req: EngineRequest, token: int) -> str | None:
        sp = req.seq.sampling
        if not sp.ignore_eos and token in self.runner.info.eos_token_ids:
            return "stop"
        if token in sp.stop_token_ids:
            return "stop"
        if req.num_output_tokens >= req.max_output:
            return "length"
        return None

    # ---------------------------------------------------------------- scheduler hooks

    def on_admit(self, req: EngineRequest, gpu_tokens: int) -> int:
        bs = self.cache.block_size
        first_time = req.num_reported_cached_tokens is None
        loaded = req.loaded if first_time else None
        req.loaded = None
        extra = 0
        tier = Medium.GPU.value
        alloc = req.alloc
        assert alloc is not None, f"{req.request_id} admitted without an allocation"
        kv = None
        if loaded is not None and loaded.num_tokens > gpu_tokens:
            kv = self.store_sync.to_runner(loaded)
        if loaded is not None and kv is None and loaded.num_tokens > gpu_tokens:
            req.store_fault = True
        if loaded is not None and kv is not None:
            num_loaded = loaded.num_tokens // bs
            self.cache.cache_blocks(alloc, req.keys[:num_loaded], req.seq.token_ids, kv, tenant=req.tenant)
            num_cached = len(alloc.keys) * bs
            if num_cached > gpu_tokens:
                req.prefix_kv = kv[:, :, :, :num_cached]
                extra = num_cached - gpu_tokens
                tier = loaded.tier
        req.num_cached_tokens = gpu_tokens + extra
        req.cached_tier = tier if req.num_cached_tokens else None
        if first_time:
            stats = self.stats
            req.num_reported_cached_tokens = req.num_cached_tokens
            req.reported_cached_by_tier = {
                t: n for t, n in ((Medium.GPU.value, gpu_tokens), (tier, extra)) if n > 0
            }
            stats.num_prefix_query_tokens += req.prompt_len
            stats.num_prefix_hit_tokens += gpu_tokens
            stats.num_prompt_tokens += req.prompt_len
            if req.num_cached_tokens:
                by_tier = stats.cached_tokens_by_tier
                by_tier[tier] = by_tier.get(tier, 0) + req.num_cached_tokens
        return extra

    def on_computed(self, req: EngineRequest) -> None:
        alloc = req.alloc
        assert alloc is not None, f"{req.request_id} computed tokens without an allocation"
        bs = self.cache.block_size
        num_full = min(req.computed // bs, len(req.keys))
        first_new = len(alloc.keys)
        if num_full <= first_new:
            return
        try:
            kv = self.runner.export_kv(req.seq, first_new * bs, num_full * bs)
        except Exception:
            # e.g. no device memory for the copy: these blocks are not cached, the request goes on
            self.stats.num_kv_export_failures += 1
            logger.exception("exporting computed KV failed; not caching %s's blocks", req.request_id)
            return
        self.cache.cache_blocks(
            alloc, req.keys[:num_full], req.seq.token_ids, kv, kv_start=first_new * bs, tenant=req.tenant
        )

    def on_prefill_done(self, req: EngineRequest) -> None:
        # Its first token is sampled in this step: the prompt's write is queued (before a release
        # in the same step frees its runner state) and the token is appended after the update.
        self._prefilled.append(req)
        self.store_sync.queue_write(req)

    def on_release(self, req: EngineRequest, why: Release) -> None:
        if why is Release.FINISHED:
            self._cache_output_blocks(req)
        elif why.preempted:
            self.stats.num_preemptions += 1
            req.num_cached_tokens = 0
            req.seq.num_computed_tokens = 0
        self.store_sync.free_runner_state(req)

    def _cache_output_blocks(self, req: EngineRequest) -> None:
        """Cache full blocks of generated text too, so the next turn of a chat reuses them."""
        alloc = req.alloc
        if alloc is None:
            return
        bs = self.cache.block_size
        computed = req.seq.token_ids[: req.seq.num_computed_tokens]
        if len(computed) // bs <= len(alloc.keys):
            return
        keys = self.cache.block_keys(computed, req.tenant)
        first_new = len(alloc.keys)
        if keys[:first_new] != alloc.keys:
            return
        try:
            kv = self.runner.export_kv(req.seq, first_new * bs, len(keys) * bs)
        except Exception:
            self.stats.num_kv_export_failures += 1
            logger.exception("exporting generated KV failed; not caching %s's output", req.request_id)
            return
        self.cache.cache_blocks(alloc, keys, computed, kv, kv_start=first_new * bs, tenant=req.tenant)

    # ---------------------------------------------------------------- endings and events

    def _finish(self, req: EngineRequest, reason: str) -> None:
        if req.finished:
            return
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        self._requests.pop(req.request_id, None)
        if reason == "abort":
            self.stats.num_aborted += 1
        else:
            self.stats.num_finished += 1
        req._emit(RequestOutput([], finished=True, finish_reason=reason))

    async def reset_prefix_cache(self) -> int | None:
        """Drop the device-tier cache (publishing AllBlocksCleared) and the store tiers only this
        engine reads (RAM, local disk), so it starts cold; a shared tier is the fleet's to empty.

        Returns:
            Store chunks removed; ``None`` (nothing done) while running requests hold blocks.
        """
        if not self.cache.reset():
            return None
        self.publish_events()
        # Writes still being copied or encoded would land after the reset: let them reach the store.
        await self.store_sync.wait(drain=False)
        return await self.store.reset_local()

    def publish_events(self) -> None:
        """Send the pending events now (the loop does this after every step and when woken idle)."""
        self._publish_events()

    def _publish_events(self) -> None:
        # Device-tier events first: a store tier's event never precedes the GPU event of its blocks,
        # and a local tier's event is told apart (tokens or not) by what these events announced.
        events = self.cache.take_events()
        if any(type(event) is AllBlocksCleared for event in events):
            self.store_sync.device_cleared()
        events += self.store_sync.take_events()
        if events:
            self.publisher.publish(events)
