"""One simulated replica: the engine's own scheduler, cost model and prefix cache in virtual time.

Admission, chunked prefill, KV accounting and preemption are the engine's
:class:`~kvmesh.engine.step_scheduler.StepScheduler`; this module prices each step with the cost
model (plus transfers from lower tiers: CPU, shared store) and moves the virtual clock::

    step time = cost_model.batch_step_time(prefill chunks, decodes, decode context) + tier loads

The device tier is the engine's :class:`~kvmesh.engine.prefix_cache.PrefixCache` (its events feed the
router's index).

Speed: while a batch only decodes, its steps are identical, so the replica schedules one wake-up at
the next completion, KV-full point or re-costing horizon instead of one event per token (the
scheduler advances a run of ``k`` steps in O(1)). An arrival that can be admitted cuts the run at the
end of the step in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.core.events import KVEvent
from kvmesh.core.types import Medium, PodId
from kvmesh.engine.cost_model import CostModel
from kvmesh.engine.prefix_cache import PrefixCache, prefix_stored_event
from kvmesh.engine.step_scheduler import (
    BatchLimits,
    Release,
    ScheduledRequest,
    SchedulerOutput,
    StepScheduler,
)
from kvmesh.sim.loop import EventLoop
from kvmesh.sim.tiers import TierStack
from kvmesh.workload import PromptBlocks

_NO_STEP: SchedulerOutput = SchedulerOutput()

RECOST_STEPS = 64
"""Longest decode run priced at one step time; contexts grow, so longer runs are re-costed."""


@dataclass(slots=True, eq=False)
class SimRequest(ScheduledRequest):
    """A request inside the simulator, from arrival to its last token."""

    index: int
    arrival: float
    prompt: list[int] | PromptBlocks
    """The prompt's tokens, or its trace blocks: then only the ranges read (the whole prompt for
    routing, new blocks for their KV events) are built, and the request never holds them."""
    output_len: int
    stage: int = 0
    group: str | None = None
    reusable: int = 0
    replica: int = -1
    gateway: int = 0
    """The router replica that routed it (see ``FleetConfig.gateways``)."""
    admitted: float = -1.0
    first_token: float = -1.0
    preempted_at: float = -1.0
    finish: float = -1.0
    failed: str | None = None
    # cache outcome of the first admission (tokens)
    hit_gpu: int = 0
    hit_cpu: int = 0
    hit_shared: int = 0
    load_s: float = 0.0

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt)
        self.max_output = self.output_len

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
        self.scheduler: StepScheduler[SimRequest] = StepScheduler(
            cache, BatchLimits(config.max_num_seqs, config.max_num_batched_tokens), self, name=str(pod)
        )
        # step in flight
        self._busy = False
        self._kick_pending = False
        self._version = 0
        self._step: SchedulerOutput[SimRequest] = _NO_STEP
        self._step_start = 0.0
        self._step_dt = 0.0
        self._step_n = 0
        self._step_began = 0.0
        self._ready = 0.0
        self._last_end = 0.0
        self._last_usage_t = 0.0
        self._last_usage = 0.0

    # ------------------------------------------------------------------ views for the router

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> deque[SimRequest]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[SimRequest]:
        return self.scheduler.running

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
        sched = self.scheduler
        was_empty = not sched.waiting
        sched.add(req)
        if not self._busy:
            if not self._kick_pending:
                # Arrivals at this same instant join the first step, as they would in an engine.
                self._kick_pending = True
                self.loop.call_at(self.loop.now, self._kick)
        elif was_empty and self._step_n > 1 and sched.can_admit_now():
            self._cut_run()

    def _kick(self) -> None:
        self._kick_pending = False
        if not self._busy:
            self._start_step()

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

    # ------------------------------------------------------------------ steps

    def _start_step(self) -> None:
        now = self.loop.now
        self._ready = now
        out = self.scheduler.schedule(RECOST_STEPS)
        for req in out.rejected:
            self._fail(req, "prompt does not fit in the replica's KV capacity")
        if out.empty:
            self._busy = False
            return
        self._busy = True
        self._step_began = now
        d = out.num_decodes
        if out.prefills:
            ranges = [(start, end) for _, start, end in out.prefills]
            dt = self.cost.batch_step_time(ranges, d, out.decode_context_tokens)
            start = self._ready
        else:
            mid_ctx = out.decode_context_tokens + d * (out.num_steps // 2)
            dt = self.cost.batch_step_time((), d, mid_ctx)
            start = now
        self._step = out
        self._step_start = start
        self._step_dt = dt
        self._step_n = out.num_steps
        self._version += 1
        self.loop.call_at(start + out.num_steps * dt, self._end_step, self._version)

    def _end_step(self, version: int) -> None:
        if version != self._version:
            return
        now = self.loop.now
        st = self.stats
        n = self._step_n
        out = self._step
        d = out.num_decodes
        dt = self._step_dt
        st.busy_s += now - self._step_began
        st.num_steps += n
        st.num_events += 1
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
        for req, start, end in out.prefills:
            if req.alloc is not None:
                st.prefill_tokens += end - start
        finished = self.scheduler.update(out, n)
        self._step = _NO_STEP
        for req in finished:
            req.finish = now
            st.num_finished += 1
            self.on_done(req)
        self.scheduler.make_room()
        self._account_usage(now)
        events = self.cache.take_events()
        if self.tiers.enabled:
            events += self.tiers.take_events()  # after the device tier's: they name its blocks
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

    # ------------------------------------------------------------------ scheduler hooks

    def on_admit(self, req: SimRequest, gpu_tokens: int) -> int:
        self.stats.num_admitted += 1
        now = self.loop.now
        loaded_until = now
        cpu_tokens = shared_tokens = 0
        if self.tiers.enabled:
            cpu_tokens, shared_tokens, loaded_until = self.tiers.load_prefix(
                req.keys, gpu_tokens, req.prompt_len - 1, now
            )
        self._ready = max(self._ready, loaded_until)
        if req.admitted < 0:
            req.admitted = now
            req.hit_gpu, req.hit_cpu, req.hit_shared = gpu_tokens, cpu_tokens, shared_tokens
            req.load_s = loaded_until - now
        return cpu_tokens + shared_tokens

    def on_computed(self, req: SimRequest) -> None:
        alloc = req.alloc
        assert alloc is not None, f"{req.request_id} computed tokens without an allocation"
        full = min(req.computed, req.prompt_len) // self.block_size
        if full > len(alloc.keys):
            self.cache.cache_blocks(alloc, req.keys[:full], req.prompt)

    def on_prefill_done(self, req: SimRequest) -> None:
        now = self.loop.now
        if req.first_token < 0:
            req.first_token = now
        elif req.preempted_at >= 0:
            self.stats.itl_values.append(now - req.preempted_at)
            self.stats.itl_weights.append(1)
            self.stats.itl_times.append(now)
            req.preempted_at = -1.0
        if self.tiers.enabled:
            shared_tokens = self.tiers.write_prefix(req.keys, req.prompt, now)
            if shared_tokens:
                self._announce_shared(req, shared_tokens)

    def _announce_shared(self, req: SimRequest, num_tokens: int) -> None:
        """Tell the router the shared tier holds ``req``'s first ``num_tokens`` (as the engine does
        once its write has landed), so every endpoint is credited with loading them."""
        keys = req.keys[: num_tokens // self.block_size]
        self.on_events(self.pod, [prefix_stored_event(keys, req.prompt, self.block_size, "", Medium.SHARED)])

    def on_release(self, req: SimRequest, why: Release) -> None:
        if why is Release.PREEMPTED_DECODING:
            req.preempted_at = self.loop.now
        if why.preempted:
            self.stats.num_preemptions += 1

    # ------------------------------------------------------------------ request lifecycle

    def _fail(self, req: SimRequest, why: str) -> None:
        req.failed = why
        req.finish = self.loop.now
        self.stats.num_failed += 1
        self.on_done(req)

    def abort(self, req: SimRequest, why: str) -> None:
        """Drop ``req`` wherever it is (the client gave up); its KV is released, it counts as failed."""
        if req.finish >= 0 or req.replica != self.index:
            return
        self.scheduler.abort(req)
        self._fail(req, why)
