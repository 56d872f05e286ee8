# Over 450 lines: FleetSimulation is the one loop that ties arrivals, routing, replicas, tiers and the network together in virtual time; its handlers share that loop's state.
"""A simulated fleet: replicas, lower tiers and the router, driven by a workload in virtual time.

    workload ──► arrivals ──► SimRouter.pick (real scheduler + index) ──► SimReplica.submit
                                  ▲                                            │
                                  └───────── KV events (real EventApplier) ◄───┘

:func:`simulate` is the entry point: same inputs and seed, same result, to the last bit.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.bench.metrics import TIMEOUT_ERROR
from kvmesh.core.types import PodId
from kvmesh.engine.cost_model import CostModel, CostPreset, get_preset
from kvmesh.engine.prefix_cache import PrefixCache
from kvmesh.errors import ConfigError
from kvmesh.router.flow_control import FlowControlConfig
from kvmesh.router.types import EndpointState
from kvmesh.sim.flow import SimFlowControl
from kvmesh.sim.ideal_cache import IdealCacheResult, IdealSharedCache
from kvmesh.sim.loop import EventLoop
from kvmesh.sim.prompt_keys import PromptKeys
from kvmesh.sim.replica import ReplicaConfig, SimReplica, SimRequest
from kvmesh.sim.routing import (
    SIM_HASH_ALGO,
    SIM_MODEL,
    SimRouter,
    resolve_policy,
    with_cost_model_prior,
)
from kvmesh.sim.tiers import SharedStore, TierStack
from kvmesh.workload import BlockWorkload, PromptBlocks, RequestSpec, Workload


@dataclass(slots=True)
class FleetConfig:
    """Everything about the simulated fleet except the workload.

    Args:
        num_replicas: engines in the fleet.
        model_preset: a cost-model preset name (``kvmesh.engine.cost_model.PRESETS``) or a preset.
        policy: a router preset name (``kvmesh.router.scheduler.PRESET_NAMES``), a scheduler YAML
            path, or a parsed scheduler config.
        block_size: device-tier block size (the router's, too).
        kv_capacity_tokens: per replica; ``None`` takes the cost model's figure.
        max_num_batched_tokens, max_num_seqs: per-step token budget and batch cap; ``None`` = preset.
        chunk_size: store chunk size of the lower tiers.
        cpu_tier_tokens: per-replica CPU tier size; 0 = none.
        shared_tier: ``None`` or a kind name ("redis", "valkey", "fs"): a fleet-wide shared store.
        shared_capacity_tokens: its size; ``None`` = effectively unbounded.
        net_gbps: each replica's NIC towards the shared tier (Gb/s, each direction).
        store_gbps: the shared store's NIC; ``None`` = not a bottleneck.
        shared_latency_s: per transfer to or from the shared tier.
        metrics_interval_s: staleness of the gauges the router's scorers read.
        queue_sample_interval_s: how often queue depth is sampled for the report.
        gpu_hour_usd: price of one GPU-hour, for cost per 1k requests.
        path_latency_s: time from the client's send to the engine's queue (gateway, tokenization,
            HTTP); it counts in TTFT and E2E.
        request_timeout_s: the client gives up on a request not finished this long after it was
            sent; the engine aborts it and it counts as failed. ``None`` = wait forever.
        max_in_flight: the client's concurrency cap (inference-perf's workers): a request due while
            this many are in flight waits at the client and is sent when one finishes; TTFT counts
            from the actual send. ``None`` = open loop.
        drain_stages: the client finishes each load stage before starting the next, as
            inference-perf does: the next stage's schedule starts once every request of the
            previous one is done (later arrivals shift by the wait).
        gateways: router replicas behind a load balancer that picks one at random per request.
            They share the event-fed index (each subscribes to every engine); each keeps its own
            plugin state, so an approximate scorer's routing history is split between them.
        seed: seeds the scheduler's randomness.
        flow_control: the router's flow control (requests wait in each gateway while every
            replica is saturated, and fail with ``shed_429`` past the deadline); ``None``: off, as
            the calibrated presets run. See :mod:`kvmesh.sim.flow`.
        model_attention_context: give a ``ttft-estimate-scorer`` that weighs prompt tokens by
            position the cost model's attention context in place of the policy's
            ``attentionContextTokens`` (off: the policy's value is the routers' prior, to see what
            they learn from a wrong one).
    """

    num_replicas: int
    model_preset: str | CostPreset = "llama-3.1-8b-h100"
    policy: str | Mapping[str, Any] = "precise"
    block_size: int = 16
    kv_capacity_tokens: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    chunk_size: int = 256
    cpu_tier_tokens: int = 0
    shared_tier: str | None = None
    shared_capacity_tokens: int | None = None
    net_gbps: float = 100.0
    store_gbps: float | None = None
    shared_latency_s: float = 1.5e-3
    metrics_interval_s: float = 0.05
    queue_sample_interval_s: float = 1.0
    gpu_hour_usd: float = 2.5
    path_latency_s: float = 0.0
    request_timeout_s: float | None = None
    max_in_flight: int | None = None
    drain_stages: bool = False
    gateways: int = 1
    seed: int = 0
    flow_control: FlowControlConfig | None = None
    model_attention_context: bool = True

    def __post_init__(self) -> None:
        if self.num_replicas <= 0:
            raise ConfigError(f"num_replicas must be positive, got {self.num_replicas}")
        if self.net_gbps <= 0:
            raise ConfigError(f"net_gbps must be positive, got {self.net_gbps}")
        if self.gateways < 1:
            raise ConfigError(f"gateways must be at least 1, got {self.gateways}")
        if self.shared_tier is not None and self.shared_tier not in ("redis", "valkey", "fs", "shared"):
            raise ConfigError(f"shared_tier must be redis, valkey, fs or shared, got {self.shared_tier!r}")

    def preset(self) -> CostPreset:
        if isinstance(self.model_preset, CostPreset):
            return self.model_preset
        try:
            return get_preset(self.model_preset)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    def policy_label(self) -> str:
        return self.policy if isinstance(self.policy, str) else "custom"


@dataclass(slots=True)
class FleetRun:
    """The raw outcome of one simulation: every request and every replica."""

    config: FleetConfig
    workload: str
    requests: list[SimRequest]
    replicas: list[SimReplica]
    shared: SharedStore | None
    router: SimRouter
    queue_samples: list[tuple[float, list[int], list[int]]]
    kv_samples: list[tuple[float, list[float]]]
    """Each replica's ``kv_cache_usage_perc`` (0..1), sampled with the queues."""
    stage_rates: list[float]
    duration_s: float
    wall_s: float
    num_events: int
    cost: CostModel
    ideal: IdealCacheResult
    """The yardstick: one shared prefix cache of the fleet's total KV, fed the same requests."""
    flow: SimFlowControl | None = None
    """The router's flow control, when it ran (its counters and queue waits)."""


class FleetSimulation:
    """Builds a fleet from a :class:`FleetConfig` and runs workloads on it (one run per instance)."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        preset = config.preset()
        self.cost = CostModel(preset)
        self.loop = EventLoop()
        capacity = config.kv_capacity_tokens or self.cost.kv_capacity_tokens()
        self.replica_config = ReplicaConfig(
            kv_capacity_tokens=capacity,
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens or preset.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs or preset.max_num_seqs,
        )
        self.shared: SharedStore | None = None
        if config.shared_tier is not None:
            cap = config.shared_capacity_tokens or 1 << 40
            self.shared = SharedStore(cap, config.chunk_size, config.store_gbps, config.shared_latency_s)
        self.replicas: list[SimReplica] = []
        for i in range(config.num_replicas):
            pod = PodId(f"sim-{i}")
            cache = PrefixCache.create_simulated(capacity, config.block_size, SIM_MODEL, SIM_HASH_ALGO.value)
            tiers = TierStack(
                self.cost,
                config.block_size,
                config.chunk_size,
                config.cpu_tier_tokens,
                self.shared,
                config.net_gbps,
                name=pod,
            )
            self.replicas.append(
                SimReplica(
                    pod,
                    i,
                    self.loop,
                    self.cost,
                    self.replica_config,
                    cache,
                    tiers,
                    self._on_events,
                    self._on_done,
                )
            )
        sched_cfg = with_cost_model_prior(
            resolve_policy(config.policy),
            prefill_tokens_per_s=self._prefill_rate(),
            queued_request_s=self.cost.cold_prefill_time(2048),
            kv_bytes_per_token=self.cost.model.kv_bytes_per_token,
            shared_gbps=config.net_gbps,
            max_batched_tokens=self.replica_config.max_num_batched_tokens,
            attention_context_tokens=(
                self.cost.model.attention_context_tokens if config.model_attention_context else 0.0
            ),
        )
        self.router = SimRouter(
            sched_cfg,
            self.replicas,
            block_size=config.block_size,
            seed=config.seed,
            metrics_interval_s=config.metrics_interval_s,
            gateways=config.gateways,
        )
        flow = config.flow_control
        self._flow = (
            None
            if flow is None or not flow.enabled
            else SimFlowControl(flow, self.router, self.loop, self._route, self._on_done)
        )
        self._keys = PromptKeys(self.replicas[0].cache.hasher)
        self._ideal = IdealSharedCache(capacity * config.num_replicas, config.block_size)
        self._done: list[SimRequest] = []
        self._sessions: dict[str, deque[SimRequest]] = {}
        self._busy_sessions: set[str] = set()
        self._session_of: dict[int, str] = {}
        self._gap_of: dict[int, float] = {}
        """Think time of queued session requests (``RequestSpec.gap_after_previous_s``), by index."""
        self._session_free: dict[str, float] = {}
        """When each idle session's last request finished (for the think time of its next one)."""
        self._pending = 0
        self._in_flight = 0
        self._held: deque[SimRequest] = deque()
        self._source: Iterator[RequestSpec] | None = None
        self._index = 0
        self._stage_starts: list[float] = []
        self._stage_pending: dict[int, int] = {}
        self._parked: RequestSpec | None = None
        """The first request of the next stage, waiting for the current stage to drain."""
        self._shift = 0.0
        """How far drains have pushed the workload's schedule back."""
        self._direct = (
            config.max_in_flight is None and config.request_timeout_s is None and config.path_latency_s <= 0
        )
        """No client cap, timeout or path latency: a sent request goes straight to the router."""
        self._queue: list[tuple[float, list[int], list[int]]] = []
        self._kv: list[tuple[float, list[float]]] = []
        self._stage_rates: list[float] = []
        self.on_progress: Callable[[int], None] | None = None
        """Called with the number of requests done after each one finishes (for progress displays)."""

    def _prefill_rate(self) -> float:
        n = 4096
        return n / self.cost.prefill_time(0, n)

    # ------------------------------------------------------------------ plumbing

    def _on_events(self, pod: PodId, events: list[Any]) -> None:
        self.router.on_events(pod, events)

    def _on_done(self, req: SimRequest) -> None:
        self.router.done(req)
        if self._flow is not None:
            self._flow.wake()
        if self.config.drain_stages:
            self._stage_done(req.stage)
        if self.config.max_in_flight is not None:
            self._in_flight -= 1
            if self._held:
                self._send(self._held.popleft())
        req.release()
        self._done.append(req)
        self._pending -= 1
        if self.on_progress is not None:
            self.on_progress(len(self._done))
        session = self._session_of.pop(req.index, None) if self._session_of else None
        if session is not None:
            waiting = self._sessions.get(session)
            if waiting:
                nxt = waiting.popleft()
                nxt.arrival = max(nxt.arrival, self.loop.now + self._gap_of.pop(nxt.index, 0.0))
                self.loop.call_at(nxt.arrival, self._send, nxt)
            else:
                self._busy_sessions.discard(session)
                self._sessions.pop(session, None)
                self._session_free[session] = self.loop.now

    def _stage_done(self, stage: int) -> None:
        left = self._stage_pending[stage] - 1
        self._stage_pending[stage] = left
        parked = self._parked
        if left or parked is None or any(n for k, n in self._stage_pending.items() if k < parked.stage):
            return
        # The stage drained: the parked stage starts now instead of at its scheduled time.
        self._parked = None
        start = (
            self._stage_starts[parked.stage] if parked.stage < len(self._stage_starts) else parked.arrival_s
        )
        self._shift = max(self._shift, self.loop.now - start)
        self._schedule(parked)

    def _next_arrival(self) -> None:
        assert self._source is not None
        spec = next(self._source, None)
        if spec is None:
            self._source = None
            return
        if self.config.drain_stages and any(n for k, n in self._stage_pending.items() if k < spec.stage):
            self._parked = spec
            return
        self._schedule(spec)

    def _schedule(self, spec: RequestSpec) -> None:
        if self.config.drain_stages:
            self._stage_pending[spec.stage] = self._stage_pending.get(spec.stage, 0) + 1
        blocks = spec.prompt_blocks
        prompt: list[int] | PromptBlocks
        if blocks is None:
            prompt = spec.prompt_token_ids
            keys = self._keys.keys(prompt, spec.prompt_id)
        else:
            prompt = blocks
            keys = self._keys.block_keys(blocks)
        req = SimRequest(
            index=self._index,
            request_id=spec.request_id,
            arrival=max(spec.arrival_s + self._shift, self.loop.now),
            prompt=prompt,
            output_len=spec.output_len,
            keys=keys,
            stage=spec.stage,
            group=spec.group,
            reusable=spec.reusable_prefix_len,
        )
        self._index += 1
        self._pending += 1
        self.loop.call_at(req.arrival, self._arrive, req, spec.session_id, spec.gap_after_previous_s)

    def _arrive(self, req: SimRequest, session: str | None, gap: float | None) -> None:
        self._next_arrival()
        if session is not None:
            self._session_of[req.index] = session
            if session in self._busy_sessions:
                if gap is not None:
                    self._gap_of[req.index] = gap
                self._sessions.setdefault(session, deque()).append(req)
                return
            self._busy_sessions.add(session)
            free = self._session_free.pop(session, None)
            if gap is not None and free is not None and free + gap > self.loop.now:
                # the session's previous request finished less than the think time ago
                req.arrival = free + gap
                self.loop.call_at(req.arrival, self._send, req)
                return
        self._send(req)

    def _send(self, req: SimRequest) -> None:
        cfg = self.config
        if self._direct:
            self._ideal.observe(req.keys, req.prompt_len)
            self._dispatch(req)
            return
        if cfg.max_in_flight is not None:
            if self._in_flight >= cfg.max_in_flight:
                self._held.append(req)
                return
            self._in_flight += 1
            req.arrival = self.loop.now
        # The yardstick sees requests in the order the client sends them: a session's next turn
        # after its previous one finished, as the fleet does.
        self._ideal.observe(req.keys, req.prompt_len)
        if cfg.request_timeout_s is not None:
            self.loop.call_at(self.loop.now + cfg.request_timeout_s, self._timeout, req)
        if cfg.path_latency_s > 0:
            self.loop.call_later(cfg.path_latency_s, self._dispatch, req)
        else:
            self._dispatch(req)

    def _timeout(self, req: SimRequest) -> None:
        if req.finish >= 0:
            return
        if req.replica < 0:
            if self._flow is not None:
                self._flow.remove(req)
            req.failed = TIMEOUT_ERROR
            req.finish = self.loop.now
            self._on_done(req)
            return
        self.replicas[req.replica].abort(req, TIMEOUT_ERROR)

    def _dispatch(self, req: SimRequest) -> None:
        if req.finish >= 0:
            return
        if self._flow is None:
            self._route(req, None)
            return
        endpoints = self._flow.admit(req)
        if endpoints is not None:  # else queued in its gateway (routed later) or shed
            self._route(req, endpoints)

    def _route(self, req: SimRequest, endpoints: list[EndpointState] | None) -> None:
        gateway = None if endpoints is None else req.gateway
        replica = self.router.route(req, self.loop.now, gateway, endpoints)
        if replica is None:
            req.failed = "no endpoint"
            req.finish = self.loop.now
            self._on_done(req)
            return
        replica.submit(req)

    def _sample_queue(self) -> None:
        now = self.loop.now
        self._queue.append(
            (now, [r.num_waiting for r in self.replicas], [r.num_running for r in self.replicas])
        )
        self._kv.append((now, [r.kv_usage for r in self.replicas]))
        if self._source is not None or self._pending > 0:
            self.loop.call_later(self.config.queue_sample_interval_s, self._sample_queue)

    # ------------------------------------------------------------------ run

    def run(self, workload: Workload, *, until: float | None = None) -> FleetRun:
        """Simulate ``workload`` to completion (or to virtual time ``until``).

        Raises:
            RuntimeError: the instance already ran.
        """
        if self.loop.num_events or self._done:
            raise RuntimeError("a FleetSimulation runs once; build a new one")
        stages = getattr(workload, "stages", None)
        self._stage_rates = [s.rate for s in stages] if stages else []
        self._stage_starts = list(itertools.accumulate((s.duration for s in stages or []), initial=0.0))
        wall = time.perf_counter()
        self._source = (
            workload.block_requests() if isinstance(workload, BlockWorkload) else iter(workload.requests())
        )
        self._next_arrival()
        self.loop.call_at(0.0, self._sample_queue)
        # The run allocates millions of long-lived objects and little cyclic garbage; the cyclic
        # collector's full passes over them grow with the run's size, so it waits until the end.
        # What earlier runs left behind (a dropped fleet is one large cycle) goes first, or it
        # would stay in memory next to this run's fleet.
        gc_was_enabled = gc.isenabled()
        if gc_was_enabled:
            gc.collect()
        gc.disable()
        try:
            self.loop.run(until)
        finally:
            if gc_was_enabled:
                gc.enable()
        # Pending client timeouts of finished requests move the clock without doing anything.
        end = max((r.finish for r in self._done), default=self.loop.now)
        for r in self.replicas:
            r.close_usage(end)
        wall = time.perf_counter() - wall
        self._done.sort(key=lambda r: r.index)
        return FleetRun(
            config=self.config,
            workload=getattr(workload, "name", type(workload).__name__),
            requests=self._done,
            replicas=self.replicas,
            shared=self.shared,
            router=self.router,
            queue_samples=self._queue,
            kv_samples=self._kv,
            stage_rates=self._stage_rates,
            duration_s=end,
            wall_s=wall,
            num_events=self.loop.num_events,
            cost=self.cost,
            ideal=self._ideal.result(),
            flow=self._flow,
        )


def simulate(config: FleetConfig, workload: Workload, *, until: float | None = None) -> FleetRun:
    """Build a fleet from ``config`` and run ``workload`` on it."""
    return FleetSimulation(config).run(workload, until=until)
