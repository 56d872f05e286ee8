"""The engine core: FCFS admission, continuous batching, prefix reuse from the cache and the store.

One asyncio task owns all scheduling state (no locks). Each iteration:

1. reap cancelled requests (free their runner state, unpin their blocks);
2. plan a step within ``max_num_batched_tokens``: one decode token per running request that finished
   its prompt, then prefill chunks of running requests, then admission of waiting requests (FCFS,
   up to ``max_num_seqs`` running, head-of-line blocking when their blocks do not fit);
3. run it on the :class:`ModelRunner`, append sampled tokens, cache newly full blocks, stream outputs;
4. publish the cache's KV events.

A request's prefix comes from the longest of: its blocks in the device-tier cache, or the store
(loaded before the request queues, so the loop never waits on the store). A cached prefix never
covers the last prompt token: that token is always computed so the runner has logits to sample from.
Chunks of new prompt KV are written to the store after the first token is out (off the TTFT path).

When a decode needs a block and none is left, the most recently admitted request is preempted: its
blocks are released and it re-queues at the front to recompute (vLLM's recompute preemption).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from kvmesh.core.event_transport import EventPublisher, NullEventPublisher
from kvmesh.core.tenancy import Role
from kvmesh.core.types import BlockKey, Medium
from kvmesh.engine.prefix_cache import Allocation, PrefixCache
from kvmesh.engine.runner import ModelRunner, PrefillChunk, SamplingParams, Sequence, StepOutput, StepPlan
from kvmesh.engine.store_connector import LoadedPrefix, NullPrefixStore, PrefixStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    write_to_store: bool = True


@dataclass(slots=True)
class RequestOutput:
    """A delta of one request's output, as the server streams it."""

    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    """"stop" (EOS or a stop token), "length", "abort" or "error"."""


@dataclass(slots=True)
class EngineStats:
    """Running totals the metrics endpoint exports."""

    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    """Prompt tokens found in the device-tier cache."""
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    """Prompt tokens served from a cache, per tier (GPU = device tier; others from the store)."""
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_store_writes: int = 0
    num_store_write_failures: int = 0
    num_store_read_failures: int = 0
    num_steps: int = 0


class EngineRequest:
    """One request inside the engine; iterate it for :class:`RequestOutput` deltas."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        tenant: str = "",
        role: Role = Role.BOTH,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), sampling)
        self.tenant = tenant
        self.role = role
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.keys: list[BlockKey] = []
        self.alloc: Allocation | None = None
        self.loaded: LoadedPrefix | None = None
        self.prefix_kv: np.ndarray | None = None
        """KV of the cached prefix for the first chunk when it came from the store."""
        self.num_cached_tokens = 0
        self.cached_tier: str | None = None
        self.num_reported_cached_tokens: int | None = None
        """Prompt tokens found cached at the first admission: what ``usage`` reports, as vLLM does.
        A preempted request re-admitted later finds its own blocks cached; that is not a hit."""
        self.num_output_tokens = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.token_gaps: list[float] = []
        """Seconds between consecutive output tokens (the inter-token latencies metrics export)."""
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.aborted = False
        self.store_done: asyncio.Future[None] | None = None
        """Set while the prompt's KV is being written to the store; done when the write finished."""
        self._store_written = False
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_done(self) -> bool:
        return self.seq.num_computed_tokens >= len(self.seq.token_ids) - (1 if self.num_output_tokens else 0)

    def output_token_ids(self) -> list[int]:
        return self.seq.token_ids[self.seq.num_prompt_tokens :]

    async def next_output(self, timeout: float | None = None) -> RequestOutput | None:
        """The next delta; ``None`` if ``timeout`` passes first."""
        if timeout is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    def drain_outputs(self) -> list[RequestOutput]:
        """Deltas already queued, without waiting."""
        items = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            out = await self._queue.get()
            yield out
            if out.finished:
                return

    def _emit(self, out: RequestOutput) -> None:
        self._queue.put_nowait(out)


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
        self.store: PrefixStore = store or NullPrefixStore()
        self.has_store = store is not None and not isinstance(store, NullPrefixStore)
        self.publisher: EventPublisher = publisher or NullEventPublisher()
        self.stats = EngineStats()
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self._requests: dict[str, EngineRequest] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._store_tasks: set[asyncio.Task[None]] = set()
        self._pending_store: list[EngineRequest] = []
        self._deferred_free: list[Sequence] = []
        self._closing = False

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
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in list(self._requests.values()):
            self._finish(req, "abort")
        if self._store_tasks:
            await asyncio.gather(*self._store_tasks, return_exceptions=True)
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
        tasks = list(self._store_tasks)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.store.drain()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

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
        try:
            req.keys = self.cache.block_keys(req.seq.token_ids, req.tenant)
            if self.has_store:
                await self._maybe_load_from_store(req)
        except BaseException:
            # Cancelled while the store answered (the client left), or bad token ids.
            self._requests.pop(req.request_id, None)
            raise
        if req.aborted:
            self._finish(req, "abort")
            return req
        self.waiting.append(req)
        self._wake.set()
        return req

    def abort(self, request_id: str) -> None:
        """Cancel a request; its slot and blocks are released before the next step. Idempotent."""
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return
        req.aborted = True
        if req in self.waiting:
            self.waiting.remove(req)
            self._finish(req, "abort")
        self._wake.set()

    def _cacheable_blocks(self, req: EngineRequest) -> int:
        """Prompt blocks a cache hit may cover: never the block holding the last prompt token."""
        return (req.num_prompt_tokens - 1) // self.cache.block_size

    async def _maybe_load_from_store(self, req: EngineRequest) -> None:
        limit_tokens = self._cacheable_blocks(req) * self.cache.block_size
        local_tokens = self.cache.match(req.keys[: self._cacheable_blocks(req)]) * self.cache.block_size
        probe = req.seq.token_ids[:limit_tokens]
        if len(probe) < self.store.chunk_size or local_tokens >= limit_tokens:
            return
        try:
            stored = await self.store.lookup(probe, req.tenant)
            loaded = await self.store.retrieve(probe, req.tenant) if stored > local_tokens else None
        except Exception:
            # The store turns tier failures into misses; anything escaping it is a store bug. It is
            # logged loudly and the request recomputes instead of failing.
            self.stats.num_store_read_failures += 1
            logger.exception("store lookup failed; recomputing")
            return
        if loaded is None or loaded.num_tokens <= local_tokens:
            return
        num_tokens = min(loaded.num_tokens, limit_tokens)
        num_tokens -= num_tokens % self.cache.block_size
        kv = loaded.kv[:, :, :, :num_tokens] if loaded.kv.shape[3] != num_tokens else loaded.kv
        req.loaded = LoadedPrefix(num_tokens, kv, loaded.tier)

    # ---------------------------------------------------------------- loop

    async def _loop(self) -> None:
        while not self._closing:
            self._reap_aborted()
            plan = self._schedule()
            if not plan.prefills and not plan.decodes:
                self._publish_events()
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                out = await self.runner.execute(plan)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("runner failed a step; failing its requests")
                for req in self._plan_requests(plan):
                    self._release(req)
                    self._finish(req, "error")
                continue
            self.stats.num_steps += 1
            self._process(plan, out)
            self._publish_events()
            # Let the server write streamed tokens before the store export copies KV.
            await asyncio.sleep(0)
            self._flush_store_writes()

    def _plan_requests(self, plan: StepPlan) -> list[EngineRequest]:
        ids = [c.seq.request_id for c in plan.prefills] + [s.request_id for s in plan.decodes]
        return [self._requests[i] for i in ids if i in self._requests]

    def _reap_aborted(self) -> None:
        for req in [r for r in self.running if r.aborted]:
            self._release(req)
            self._finish(req, "abort")

    def _schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        plan = StepPlan()
        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running or not req.prefill_done:
                continue
            if not self._ensure_block_for_next_token(req):
                continue
            plan.decodes.append(req.seq)
            budget -= 1
        for req in self.running:
            if budget <= 0:
                break
            if req.prefill_done:
                continue
            budget -= self._add_prefill_chunk(plan, req, budget)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            budget -= self._add_prefill_chunk(plan, req, budget)
        return plan

    def _add_prefill_chunk(self, plan: StepPlan, req: EngineRequest, budget: int) -> int:
        seq = req.seq
        first = seq.num_computed_tokens == 0
        start = req.num_cached_tokens if first else seq.num_computed_tokens
        end = min(len(seq.token_ids), start + budget)
        chunk = PrefillChunk(seq, start, end)
        if first and start > 0:
            chunk.cached_tier = req.cached_tier
            if req.prefix_kv is not None and req.prefix_kv.shape[3] == start:
                chunk.cached_kv = req.prefix_kv
            else:
                chunk.cached_kv = self.cache.get_kv(req.keys[: start // self.cache.block_size])
            req.prefix_kv = None
        plan.prefills.append(chunk)
        return end - start

    def _admit(self, req: EngineRequest) -> bool:
        """Pin the request's cached prefix and reserve its prompt blocks; ``False`` if they do not fit."""
        bs = self.cache.block_size
        cacheable = self._cacheable_blocks(req)
        num_local = self.cache.match(req.keys[:cacheable])
        first_time = req.num_reported_cached_tokens is None
        num_loaded = req.loaded.num_tokens // bs if req.loaded is not None and first_time else 0
        num_cached = max(num_local, num_loaded)
        total_blocks = -(-len(req.seq.token_ids) // bs)
        alloc = self.cache.allocate(req.request_id, req.keys, num_local, total_blocks - num_local)
        if alloc is None:
            return False
        req.alloc = alloc
        if num_loaded > num_local and req.loaded is not None:
            kv = req.loaded.kv
            self.cache.cache_blocks(
                alloc, req.keys[:num_loaded], req.seq.token_ids, kv, kv_start=0, tenant=req.tenant
            )
            if len(alloc.keys) < num_loaded:
                num_cached = len(alloc.keys)
            req.prefix_kv = kv[:, :, :, : num_cached * bs]
            tier = req.loaded.tier
        else:
            num_cached = num_local
            tier = Medium.GPU.value
        req.loaded = None
        req.num_cached_tokens = num_cached * bs
        req.cached_tier = tier if num_cached else None
        if first_time:
            req.num_reported_cached_tokens = req.num_cached_tokens
            self.stats.num_prefix_query_tokens += req.num_prompt_tokens
            self.stats.num_prefix_hit_tokens += num_local * bs
            self.stats.num_prompt_tokens += req.num_prompt_tokens
            if num_cached:
                by_tier = self.stats.cached_tokens_by_tier
                by_tier[tier] = by_tier.get(tier, 0) + num_cached * bs
        return True

    def _ensure_block_for_next_token(self, req: EngineRequest) -> bool:
        """Make room for the KV of the token this decode computes; preempt others if needed."""
        alloc = req.alloc
        assert alloc is not None, f"running request {req.request_id} has no allocation"
        bs = self.cache.block_size
        needed = -(-len(req.seq.token_ids) // bs)
        while len(alloc.keys) + alloc.num_reserved < needed:
            if self.cache.grow(alloc, 1):
                return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: EngineRequest) -> None:
        self.stats.num_preemptions += 1
        self._release(req)
        req.seq.num_computed_tokens = 0
        req.num_cached_tokens = 0
        self.waiting.appendleft(req)

    def _release(self, req: EngineRequest) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.alloc is not None:
            self.cache.free(req.alloc)
            req.alloc = None
        if req in self._pending_store:
            self._deferred_free.append(req.seq)
        else:
            self.runner.free(req.seq)

    # ---------------------------------------------------------------- step results

    def _process(self, plan: StepPlan, out: StepOutput) -> None:
        now = time.monotonic()
        for chunk in plan.prefills:
            req = self._requests.get(chunk.seq.request_id)
            if req is None or req.alloc is None:
                continue
            self._cache_prompt_blocks(req, chunk.start)
            token = out.sampled.get(req.request_id)
            if token is not None:
                self._maybe_write_store(req)
                self._append_token(req, token, now)
        for seq in plan.decodes:
            req = self._requests.get(seq.request_id)
            token = out.sampled.get(seq.request_id)
            if req is None or token is None or req.alloc is None:
                continue
            self._append_token(req, token, now)

    def _cache_prompt_blocks(self, req: EngineRequest, chunk_start: int) -> None:
        alloc = req.alloc
        assert alloc is not None
        bs = self.cache.block_size
        num_full = min(req.seq.num_computed_tokens // bs, len(req.keys))
        first_new = len(alloc.keys)
        if num_full <= first_new:
            return
        kv = self.runner.export_kv(req.seq, first_new * bs, num_full * bs)
        self.cache.cache_blocks(
            alloc, req.keys[:num_full], req.seq.token_ids, kv, kv_start=first_new * bs, tenant=req.tenant
        )

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
        if reason is not None:
            self._cache_output_blocks(req)
            self._release(req)
            self._finish(req, reason)

    def _stop_reason(self, req: EngineRequest, token: int) -> str | None:
        sp = req.seq.sampling
        if not sp.ignore_eos and token in self.runner.info.eos_token_ids:
            return "stop"
        if token in sp.stop_token_ids:
            return "stop"
        if req.num_output_tokens >= sp.max_tokens or req.role is Role.PREFILL:
            return "length"
        if len(req.seq.token_ids) >= self.runner.info.max_model_len:
            return "length"
        return None

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
        kv = self.runner.export_kv(req.seq, first_new * bs, len(keys) * bs)
        self.cache.cache_blocks(alloc, keys, computed, kv, kv_start=first_new * bs, tenant=req.tenant)

    def _maybe_write_store(self, req: EngineRequest) -> None:
        """Queue the prompt's new full chunks for the store (once per request, after the token is out)."""
        if not self.has_store or not self.config.write_to_store or req._store_written:
            return
        req._store_written = True
        chunk = self.store.chunk_size
        n = (req.num_prompt_tokens // chunk) * chunk
        # A cached prefix this long was written when it was first computed (or came from the store).
        if n == 0 or n <= req.num_cached_tokens:
            return
        req.store_done = asyncio.get_running_loop().create_future()
        self._pending_store.append(req)

    def _flush_store_writes(self) -> None:
        """Export queued prompts' KV and hand it to background store writes; then free deferred state."""
        pending, self._pending_store = self._pending_store, []
        for req in pending:
            n = (req.num_prompt_tokens // self.store.chunk_size) * self.store.chunk_size
            kv = self.runner.export_kv(req.seq, 0, n)
            done = req.store_done
            assert done is not None, "queued store write without its future"
            if kv is None:
                done.set_result(None)
                continue
            skip = req.num_cached_tokens
            drain = req.role is Role.PREFILL
            task = asyncio.create_task(
                self._write_store(req.seq.token_ids[:n], req.tenant, kv, skip, drain, done)
            )
            self._store_tasks.add(task)
            task.add_done_callback(self._store_tasks.discard)
        deferred, self._deferred_free = self._deferred_free, []
        for seq in deferred:
            self.runner.free(seq)

    async def _write_store(
        self,
        tokens: list[int],
        tenant: str,
        kv: np.ndarray,
        skip: int,
        drain: bool,
        done: asyncio.Future[None],
    ) -> None:
        try:
            await self.store.store(tokens, tenant, kv, skip)
            if drain:
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

    def publish_events(self) -> None:
        """Send the cache's pending events now (the loop does this after every step)."""
        self._publish_events()

    def _publish_events(self) -> None:
        events = self.cache.take_events()
        if events:
            self.publisher.publish(events)
