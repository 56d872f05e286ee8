"""One simulated replica: continuous batching over the engine's cost model and prefix cache.

Per step (vLLM v1's scheduler, in virtual time)::

    budget = max_num_batched_tokens
    1. every decoding sequence takes one token             (decodes are never starved)
    2. sequences mid-prefill take their next chunk          (chunked prefill, admission order)
    3. waiting requests are admitted, FCFS, while budget, max_num_seqs and KV allow;
       an admitted request pins its cached prefix blocks (device tier), pulls what lower
       tiers hold (CPU, shared store: transfer time on the links) and reserves the rest
    step time = cost_model.step_time(prefill chunks, decode contexts) + tier loads

The device tier is the engine's own :class:`~kvmesh.engine.prefix_cache.PrefixCache` (its events feed
the router's index). Generated tokens live in one replica-wide reservation on that cache, so prompt
blocks, decode tokens and evictable cached blocks share the replica's KV capacity as in vLLM. When
decodes outgrow it, the newest running request is preempted (recompute mode: it keeps its output and
recomputes its KV when readmitted).

Speed: while a batch only decodes, its steps are identical, so the replica schedules one wake-up at
the next completion, KV-full point or re-costing horizon instead of one event per token. Decoding
sequences advance by a replica-wide step counter (``generated = steps - base``), so a run of ``k``
steps costs O(1) however large the batch. An arrival that can be admitted cuts the run at the end of
the step in flight.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.bench.trace_blocks import PromptBlocks
from kvmesh.core.events import KVEvent
from kvmesh.core.types import BlockKey, PodId
from kvmesh.engine.cost_model import CostModel
from kvmesh.engine.prefix_cache import Allocation, PrefixCache
from kvmesh.sim.loop import EventLoop
from kvmesh.sim.tiers import TierStack

RECOST_STEPS = 64
"""Longest decode run priced at one step time; contexts grow, so longer runs are re-costed."""


@dataclass(slots=True, eq=False)
class SimRequest:
    """A request inside the simulator, from arrival to its last token."""

    index: int
    request_id: str
    arrival: float
    prompt: list[int] | PromptBlocks
    """The prompt's tokens, or its trace blocks: then only the ranges read (the whole prompt for
    routing, new blocks for their KV events) are built, and the request never holds them."""
    output_len: int
    keys: list[BlockKey]
    """Device-tier block keys of the prompt's full blocks."""
    prompt_len: int = 0
    """Prompt tokens (kept after :meth:`release` drops the prompt at the end of the request)."""
    stage: int = 0
    group: str | None = None
    reusable: int = 0
    replica: int = -1
    gateway: int = 0
    """The router replica that routed it (see ``FleetConfig.gateways``)."""
    # progress (owned by the replica)
    target: int = 0
    computed: int = 0
    generated: int = 0
    base: int = 0
    version: int = 0
    alloc: Allocation | None = None
    private: int = 0
    """Tokens of this request counted in the replica's decode reservation (prompt tail + recompute)."""
    admitted: float = -1.0
    first_token: float = -1.0
    preempted_at: float = -1.0
    finish: float = -1.0
    failed: str | None = None
    # cache outcome of the first admission (tokens)
    hit_gpu: int = 0
    hit_cpu: int = 0
    hit_shared: int = 0
    num_preemptions: int = 0
    load_s: float = 0.0

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt)

    @property
    def tokens(self) -> list[int]:
        """The prompt's token ids; a new list on every read of a block prompt."""
        prompt = self.prompt
        return prompt if isinstance(prompt, list) else prompt.token_ids()

    @property
    def cached_tokens(self) -> int:
        return self.hit_gpu + self.hit_cpu + self.hit_shared

    def release(self) -> None:
        """Drop the prompt and its keys once the request is over (its figures stay)."""
        self.prompt = []
        self.keys = []


@dataclass(slots=True)
class ReplicaConfig:
    """Engine knobs of one replica (vLLM's names)."""

    kv_capacity_tokens: int
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError(f"kv_capacity_tokens={self.kv_capacity_tokens} is below one block")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")


@dataclass(slots=True)
class ReplicaStats:
    """What a replica accumulates over a run."""

    busy_s: float = 0.0
    num_steps: int = 0
    num_events: int = 0
    num_admitted: int = 0
    num_finished: int = 0
    num_failed: int = 0
    num_preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    kv_usage_integral: float = 0.0
    """∫ kv usage dt (device tier, 0..1), for the time-weighted mean."""
    itl_values: list[float] = field(default_factory=list)
    itl_weights: list[int] = field(default_factory=list)
    itl_times: list[float] = field(default_factory=list)
    """Virtual time each ITL sample was recorded (its step's end)."""


class SimReplica:
    """A replica in virtual time.

    Args:
        pod: the replica's id in the router and in its KV events.
        loop: the shared virtual clock.
        cost: the engine's cost model.
        config: batching and KV knobs.
        cache: the engine's device-tier prefix cache (simulated constructor).
        tiers: lower tiers this replica reads and writes (CPU, shared store).
        on_events: receives the device tier's KV events after every step.
        on_done: called with each request that finished or failed.
    """

    def __init__(
        self,
        pod: PodId,
        index: int,
        loop: EventLoop,
        cost: CostModel,
        config: ReplicaConfig,
        cache: PrefixCache,
        tiers: TierStack,
        on_events: Callable[[PodId, list[KVEvent]], None],
        on_done: Callable[[SimRequest], None],
    ) -> None:
        self.pod = pod
        self.index = index
        self.loop = loop
        self.cost = cost
        self.config = config
        self.cache = cache
        self.tiers = tiers
        self.on_events = on_events
        self.on_done = on_done
        self.stats = ReplicaStats()
        self.block_size = cache.block_size
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.running: list[SimRequest] = []
        """Admitted and not finished, in admission order (the newest is preempted first)."""
        self.num_decoding = 0
        self._finish_heap: list[tuple[int, int, int, SimRequest]] = []
        self._steps = 0
        self._sum_base = 0
        self._sum_prompt_decoding = 0
        self._private_fixed = 0
        reserve = cache.allocate(f"{pod}/decode", [], 0, 0)
        assert reserve is not None, "an empty reservation always fits"
        self._reserve: Allocation = reserve
        self._reserved_blocks = 0
        # step in flight
        self._busy = False
        self._version = 0
        self._step_start = 0.0
        self._step_dt = 0.0
        self._step_n = 0
        self._step_chunks: list[tuple[SimRequest, int]] = []
        self._step_began = 0.0
        self._last_end = 0.0
        self._preempted_this_step = False
        self._last_usage_t = 0.0
        self._last_usage = 0.0

    # ------------------------------------------------------------------ views for the router

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc`` (0..1): blocks held by running requests."""
        return self.cache.usage

    # ------------------------------------------------------------------ arrivals

    def submit(self, req: SimRequest) -> None:
        """Queue a request at the current virtual time."""
        req.replica = self.index
        if req.prompt_len + req.output_len + 2 * self.block_size > self.config.kv_capacity_tokens:
            self._fail(req, "prompt + output exceed the replica's KV capacity")
            return
        was_empty = not self.waiting
        self.waiting.append(req)
        if not self._busy:
            self._start_step()
        elif was_empty and self._step_n > 1 and len(self.running) < self.config.max_num_seqs:
            self._cut_run()

    def _cut_run(self) -> None:
        """End the decode run in flight at the end of its current step, so a new request can join."""
        now = self.loop.now
        dt = self._step_dt
        done = int((now - self._step_start) / dt) + 1
        if done >= self._step_n:
            return
        self._step_n = done
        self._version += 1
        self.loop.call_at(self._step_start + done * dt, self._end_step, self._version)

    # ------------------------------------------------------------------ KV accounting

    def _private_tokens(self) -> int:
        return self._private_fixed + self.num_decoding * self._steps - self._sum_base

    def _private_blocks(self, extra_tokens: int = 0) -> int:
        tokens = self._private_tokens() + extra_tokens
        return -(-tokens // self.block_size) + len(self.running)

    def _sync_reservation(self) -> bool:
        """Make the replica-wide decode reservation match the private tokens; ``False`` if it cannot grow."""
        want = self._private_blocks()
        have = self._reserved_blocks
        if want > have:
            if not self.cache.grow(self._reserve, want - have):
                return False
        elif want < have:
            self.cache.shrink(self._reserve, have - want)
        self._reserved_blocks = want
        return True

    def _free_blocks(self) -> int:
        return self.cache.capacity_blocks - self.cache.num_used_blocks

    # ------------------------------------------------------------------ steps

    def _start_step(self) -> None:
        now = self.loop.now
        cfg = self.config
        budget = cfg.max_num_batched_tokens - self.num_decoding
        chunks: list[tuple[SimRequest, int]] = []
        prefill_ranges: list[tuple[int, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.target - req.computed, budget)
            chunks.append((req, n))
            prefill_ranges.append((req.computed, req.computed + n))
            budget -= n
        ready = now
        admit = not self._preempted_this_step
        self._preempted_this_step = False
        while admit and budget > 0 and self.waiting and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            loaded = self._admit(req)
            if loaded is None:
                if not self.running:
                    self.waiting.popleft()
                    self._fail(req, "prompt does not fit in the replica's KV capacity")
                    continue
                break
            self.waiting.popleft()
            ready = max(ready, loaded)
            n = min(req.target - req.computed, budget)
            chunks.append((req, n))
            prefill_ranges.append((req.computed, req.computed + n))
            budget -= n
        d = self.num_decoding
        if not chunks and d == 0:
            self._busy = False
            return
        self._busy = True
        self._step_began = now
        ctx_total = self._sum_prompt_decoding + self._private_generated() + d
        if chunks:
            dt = self.cost.batch_step_time(prefill_ranges, d, ctx_total)
            n_steps = 1
            start = ready
        else:
            n_steps = self._run_length(d)
            if n_steps == 0:
                self._preempt_newest()
                self._start_step()
                return
            mid_ctx = ctx_total + d * (n_steps // 2)
            dt = self.cost.batch_step_time((), d, mid_ctx)
            start = now
        self._step_chunks = chunks
        self._step_start = start
        self._step_dt = dt
        self._step_n = n_steps
        self._version += 1
        self.loop.call_at(start + n_steps * dt, self._end_step, self._version)

    def _private_generated(self) -> int:
        return self.num_decoding * self._steps - self._sum_base

    def _run_length(self, d: int) -> int:
        """Decode steps until the next completion, the KV-full point, or the re-costing horizon."""
        heap = self._finish_heap
        while heap and heap[0][2] != heap[0][3].version:
            heapq.heappop(heap)
        k = RECOST_STEPS
        if heap:
            k = min(k, max(1, heap[0][0] - self._steps))
        # Each step adds d tokens; full blocks are reserved as tokens cross block boundaries.
        free_tokens = (self._free_blocks() + self._reserved_blocks - len(self.running)) * self.block_size
        free_tokens -= self._private_tokens()
        return max(0, min(k, free_tokens // d))

    def _end_step(self, version: int) -> None:
        if version != self._version:
            return
        now = self.loop.now
        st = self.stats
        n = self._step_n
        d = self.num_decoding
        dt = self._step_dt
        st.busy_s += now - self._step_began
        st.num_steps += n
        st.num_events += 1
        self._steps += n
        if d:
            st.decode_tokens += d * n
            first_gap = self._step_start + dt - self._last_end
            st.itl_values.append(first_gap)
            st.itl_weights.append(d)
            st.itl_times.append(now)
            if n > 1:
                st.itl_values.append(dt)
                st.itl_weights.append(d * (n - 1))
                st.itl_times.append(now)
        self._last_end = now
        for req, chunk in self._step_chunks:
            req.computed += chunk
            st.prefill_tokens += chunk
            self._cache_computed(req)
            if req.computed >= req.target:
                self._prefill_done(req, now)
        self._step_chunks = []
        heap = self._finish_heap
        while heap and heap[0][0] <= self._steps:
            _, _, ver, req = heapq.heappop(heap)
            if ver == req.version:
                self._finish(req, now)
        self._maybe_preempt()
        if not self.running:  # otherwise _maybe_preempt left the reservation in sync
            self._sync_reservation()
        self._account_usage(now)
        events = self.cache.take_events()
        if events:
            self.on_events(self.pod, events)
        self._start_step()

    def _account_usage(self, now: float) -> None:
        self.stats.kv_usage_integral += self._last_usage * (now - self._last_usage_t)
        self._last_usage_t = now
        self._last_usage = self.cache.usage

    def close_usage(self, now: float) -> None:
        """Close the KV-usage integral at the end of the run."""
        self._account_usage(now)

    # ------------------------------------------------------------------ request lifecycle

    def _admit(self, req: SimRequest) -> float | None:
        """Pin the cached prefix, pull lower-tier chunks, reserve the rest; ``None`` if KV is short.

        Returns:
            The virtual time at which the request's loaded KV is in device memory.
        """
        bs = self.block_size
        cache = self.cache
        keys = req.keys
        resumed = req.generated > 0
        max_blocks = (req.prompt_len - 1) // bs
        hit = min(cache.match(keys), max_blocks)
        tail = req.prompt_len - len(keys) * bs + (req.generated if resumed else 0)
        new_blocks = len(keys) - hit
        alloc = cache.allocate(req.request_id, keys, hit, new_blocks)
        if alloc is None:
            return None
        want = -(-(self._private_tokens() + tail) // bs) + len(self.running) + 1
        if want > self._reserved_blocks and not cache.grow(self._reserve, want - self._reserved_blocks):
            cache.free(alloc)
            return None
        self._reserved_blocks = max(want, self._reserved_blocks)
        req.alloc = alloc
        req.private = tail
        self._private_fixed += tail
        self.running.append(req)
        self.prefilling.append(req)
        self.stats.num_admitted += 1
        now = self.loop.now
        gpu_tokens = hit * bs
        loaded_until = now
        cpu_tokens = shared_tokens = 0
        if self.tiers.enabled:
            cpu_tokens, shared_tokens, loaded_until = self.tiers.load_prefix(
                keys, gpu_tokens, req.prompt_len - 1, now
            )
        start = gpu_tokens + cpu_tokens + shared_tokens
        req.target = req.prompt_len + (req.generated if resumed else 0)
        req.computed = start
        if req.admitted < 0:
            req.admitted = now
            req.hit_gpu, req.hit_cpu, req.hit_shared = gpu_tokens, cpu_tokens, shared_tokens
            req.load_s = loaded_until - now
        if start > gpu_tokens:
            self._cache_computed(req)
        if self._reserved_blocks != want:  # want counts this request: only a shrink can be due
            self._sync_reservation()
        return loaded_until

    def _cache_computed(self, req: SimRequest) -> None:
        alloc = req.alloc
        assert alloc is not None, f"{req.request_id} computed tokens without an allocation"
        full = min(req.computed, req.prompt_len) // self.block_size
        if full > len(alloc.keys):
            self.cache.cache_blocks(alloc, req.keys[:full], req.prompt)

    def _prefill_done(self, req: SimRequest, now: float) -> None:
        self.prefilling.remove(req)
        if req.first_token < 0:
            req.first_token = now
        elif req.preempted_at >= 0:
            self.stats.itl_values.append(now - req.preempted_at)
            self.stats.itl_weights.append(1)
            self.stats.itl_times.append(now)
            req.preempted_at = -1.0
        if self.tiers.enabled:
            self.tiers.write_prefix(req.keys, req.prompt, now)
        g = req.generated + 1
        self._private_fixed -= req.private
        req.private = req.prompt_len - len(req.keys) * self.block_size
        self._private_fixed += req.private
        if g >= req.output_len:
            req.generated = req.output_len
            self._finish(req, now, decoding=False)
            return
        req.base = self._steps - g
        self.num_decoding += 1
        self._sum_base += req.base
        self._sum_prompt_decoding += req.prompt_len
        heapq.heappush(self._finish_heap, (req.base + req.output_len, req.index, req.version, req))

    def _stop_decoding(self, req: SimRequest) -> None:
        req.generated = self._steps - req.base
        self.num_decoding -= 1
        self._sum_base -= req.base
        self._sum_prompt_decoding -= req.prompt_len
        req.version += 1

    def _finish(self, req: SimRequest, now: float, decoding: bool = True) -> None:
        if decoding:
            self._stop_decoding(req)
        req.finish = now
        self._release(req)
        self.stats.num_finished += 1
        self.on_done(req)

    def _release(self, req: SimRequest) -> None:
        self.running.remove(req)
        self._private_fixed -= req.private
        req.private = 0
        if req.alloc is not None:
            self.cache.free(req.alloc)
            req.alloc = None

    def _fail(self, req: SimRequest, why: str) -> None:
        req.failed = why
        req.finish = self.loop.now
        self.stats.num_failed += 1
        self.on_done(req)

    def abort(self, req: SimRequest, why: str) -> None:
        """Drop ``req`` wherever it is (the client gave up); its KV is released, it counts as failed."""
        if req.finish >= 0 or req.replica != self.index:
            return
        if req.alloc is None:
            self.waiting.remove(req)
        else:
            if req in self.prefilling:
                self.prefilling.remove(req)
                for i, (r, _) in enumerate(self._step_chunks):
                    if r is req:
                        del self._step_chunks[i]
                        break
            else:
                self._stop_decoding(req)
            self._release(req)
            self._sync_reservation()
        self._fail(req, why)

    def _maybe_preempt(self) -> None:
        """Preempt the newest requests until the next step's decode tokens fit."""
        while self.running and not self._sync_reservation():
            self._preempt_newest()
        while self.num_decoding and self._run_length(self.num_decoding) == 0 and len(self.running) > 1:
            self._preempt_newest()

    def _preempt_newest(self) -> None:
        req = self.running[-1]
        if req in self.prefilling:
            self.prefilling.remove(req)
        else:
            self._stop_decoding(req)
            req.preempted_at = self.loop.now
        self._release(req)
        self._preempted_this_step = True
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)
        self._sync_reservation()
