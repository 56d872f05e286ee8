"""Turn a :class:`~kvmesh.sim.fleet.FleetRun` into the bench harness's metrics, plus fleet figures.

Requests become :class:`kvmesh.bench.metrics.RequestResult` and are summarised by the bench's own
``summarize``/``summarize_stages``, so a simulated run prints, serialises and plots exactly like a
measured one. Two figures are computed here instead:

- ITL: the simulator does not keep one gap per token (a million requests × a thousand tokens);
  every decode step records its gap once with a weight (the sequences that got a token), and the
  distribution is the weighted one, which equals the pooled per-token distribution.
- Fleet figures the bench cannot see: per-replica utilisation (busy fraction, mean KV usage),
  prompt tokens served by tier, bytes moved to and from the shared tier, and the hit rate against
  the ideal shared cache of the fleet's total KV (:mod:`kvmesh.sim.ideal_cache`).
- With the router's flow control on: requests that waited in it, how long, and how many it shed
  (``shed_429``: the summary's ``num_shed``, apart from ``num_failed`` and ``num_timeouts``; TTFT and
  the other latencies are over completed requests, queue wait included).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvmesh.bench.metrics import (
    Dist,
    QueueSample,
    RequestResult,
    RunResult,
    Summary,
    summarize,
    summarize_stages,
)
from kvmesh.sim.fleet import FleetRun
from kvmesh.sim.ideal_cache import IdealCacheResult


def weighted_dist(values: np.ndarray, weights: np.ndarray) -> Dist:
    """Mean, median, p90, p99 and max of ``values`` where value i occurs ``weights[i]`` times.

    Percentiles use the lower-value convention on the cumulative weight (no interpolation).
    """
    mask = weights > 0
    values, weights = values[mask], weights[mask]
    if values.size == 0:
        return Dist()
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order].astype(np.float64)
    cum = np.cumsum(w)
    total = cum[-1]

    def pct(q: float) -> float:
        return float(v[min(int(np.searchsorted(cum, q * total, side="left")), v.size - 1)])

    return Dist(
        mean=float(np.dot(v, w) / total),
        median=pct(0.5),
        p90=pct(0.9),
        p99=pct(0.99),
        max=float(v[-1]),
        count=int(total),
    )


@dataclass(slots=True)
class ReplicaReport:
    """One replica over the run."""

    pod: str
    busy_frac: float
    """Fraction of the run the replica spent in steps."""
    kv_usage_mean: float
    """Time-weighted mean of ``kv_cache_usage_perc`` (0..1)."""
    num_finished: int
    num_preemptions: int
    prefill_tokens: int
    decode_tokens: int
    num_steps: int
    shared_read_bytes: int
    shared_write_bytes: int


@dataclass(slots=True)
class TierReport:
    """Prompt tokens by where they came from, over the whole run."""

    prompt_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    shared_hit_tokens: int

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.gpu_hit_tokens - self.cpu_hit_tokens - self.shared_hit_tokens

    def rates(self) -> dict[str, float]:
        """Hit rate per tier (share of prompt tokens) and in total."""
        p = max(self.prompt_tokens, 1)
        hit = self.gpu_hit_tokens + self.cpu_hit_tokens + self.shared_hit_tokens
        return {
            "gpu": self.gpu_hit_tokens / p,
            "cpu": self.cpu_hit_tokens / p,
            "shared": self.shared_hit_tokens / p,
            "total": hit / p,
        }


@dataclass(slots=True)
class NetworkReport:
    """Traffic between the replicas and the shared tier."""

    read_bytes: int
    write_bytes: int
    read_gbps_mean: float
    write_gbps_mean: float
    read_gbps_peak_replica: float
    """Busiest replica NIC (receive), mean over the run, Gb/s."""


@dataclass(slots=True)
class FlowReport:
    """The router's flow control over the run (every gateway together)."""

    num_admitted: int
    """Routed at once."""
    num_queued: int
    """Had to wait."""
    num_dispatched: int
    """Waited, then were routed."""
    num_shed: int
    """Refused (``shed_429``): past the deadline, or the queue was full."""
    num_removed: int
    """The client gave up while they waited (counted as timeouts)."""
    wait: Dist
    """Seconds queued, over the requests that waited and were routed."""


@dataclass(slots=True)
class SimReport:
    """A simulated run in the bench's terms plus the fleet's own figures."""

    label: str
    run: RunResult
    replicas: list[ReplicaReport]
    tiers: TierReport
    network: NetworkReport
    num_replicas: int
    gpus_per_replica: int
    duration_s: float
    cost_per_1k_usd: float
    """GPU cost of the fleet for the run's duration, per thousand completed requests."""
    wall_s: float
    num_events: int
    num_preemptions: int
    ideal: IdealCacheResult
    """The yardstick: one LRU prefix cache of the fleet's total KV fed the same requests
    (:mod:`kvmesh.sim.ideal_cache`)."""
    stage_kv_peak: list[float] = field(default_factory=list)
    """Per entry of ``run.stages``: the highest KV usage (0..1) any replica was sampled at (every
    ``queue_sample_interval_s``), from the stage's first arrival to the next stage's, drain included."""
    flow: FlowReport | None = None
    """The router's flow control (``None``: off)."""

    @property
    def summary(self) -> Summary:
        return self.run.summary

    @property
    def hit_rate_vs_ideal(self) -> float | None:
        """The run's hit rate (all tiers) as a share of the ideal shared cache's; ``None`` when that is 0."""
        ideal = self.ideal.hit_rate
        return self.tiers.rates()["total"] / ideal if ideal > 0 else None

    def to_dict(self, *, include_requests: bool = False) -> dict[str, Any]:
        out = self.run.to_dict(include_requests=include_requests)
        out.update(
            {
                "replicas": [msgspec.to_builtins(dataclasses.asdict(r)) for r in self.replicas],
                "hit_rate_by_tier": self.tiers.rates(),
                "tier_tokens": dataclasses.asdict(self.tiers),
                "network": dataclasses.asdict(self.network),
                "num_replicas": self.num_replicas,
                "gpus_per_replica": self.gpus_per_replica,
                "sim_duration_s": self.duration_s,
                "cost_per_1k_usd": self.cost_per_1k_usd,
                "wall_s": self.wall_s,
                "num_events": self.num_events,
                "num_preemptions": self.num_preemptions,
                "stage_kv_peak": self.stage_kv_peak,
                "ideal_shared_cache": {
                    **dataclasses.asdict(self.ideal),
                    "hit_rate": self.ideal.hit_rate,
                },
                "hit_rate_vs_ideal": self.hit_rate_vs_ideal,
                "flow_control": None if self.flow is None else msgspec.to_builtins(self.flow),
            }
        )
        return out


def _results(run: FleetRun) -> list[RequestResult]:
    out: list[RequestResult] = []
    append = out.append
    pods = [r.pod for r in run.replicas]
    for q in run.requests:
        ok = q.failed is None and q.finish >= 0
        append(
            RequestResult(
                request_id=q.request_id,
                stage=q.stage,
                send_s=q.arrival,
                ok=ok,
                prompt_tokens=q.prompt_len,
                output_tokens=q.output_len if ok else 0,
                cached_tokens=q.cached_tokens,
                reusable_prefix_len=q.reusable,
                ttft_s=q.first_token - q.arrival if ok else None,
                e2e_s=q.finish - q.arrival if ok else None,
                error=q.failed,
                group=q.group,
                endpoint=pods[q.replica] if q.replica >= 0 else None,
            )
        )
    return out


def _itl(run: FleetRun) -> Dist:
    values: list[float] = []
    weights: list[int] = []
    for r in run.replicas:
        values.extend(r.stats.itl_values)
        weights.extend(r.stats.itl_weights)
    return weighted_dist(np.asarray(values, dtype=np.float64), np.asarray(weights, dtype=np.int64))


def _queue(run: FleetRun) -> list[QueueSample]:
    pods = [r.pod for r in run.replicas]
    return [
        QueueSample(
            t, dict(zip(pods, map(float, w), strict=True)), dict(zip(pods, map(float, rn), strict=True))
        )
        for t, w, rn in run.queue_samples
    ]


def build_report(run: FleetRun, label: str | None = None) -> SimReport:
    """Summarise a simulated run with the bench's metrics and the fleet's own figures."""
    label = label or run.config.policy_label()
    results = _results(run)
    queue = _queue(run)
    itl = _itl(run)
    summary = dataclasses.replace(summarize(results, queue), itl=itl)
    stages = summarize_stages(results, queue, run.stage_rates or None)
    stage_itl = _stage_itl(run, stages)
    stages = [dataclasses.replace(s, itl=d) for s, d in zip(stages, stage_itl, strict=True)]
    bench_run = RunResult(label, run.workload, results, queue, run.stage_rates, summary, stages)

    dur = max(run.duration_s, 1e-9)
    replicas = []
    for r in run.replicas:
        st, ts = r.stats, r.tiers.stats
        replicas.append(
            ReplicaReport(
                pod=r.pod,
                busy_frac=st.busy_s / dur,
                kv_usage_mean=st.kv_usage_integral / dur,
                num_finished=st.num_finished,
                num_preemptions=st.num_preemptions,
                prefill_tokens=st.prefill_tokens,
                decode_tokens=st.decode_tokens,
                num_steps=st.num_steps,
                shared_read_bytes=ts.shared_read_bytes,
                shared_write_bytes=ts.shared_write_bytes,
            )
        )
    ok = [q for q in run.requests if q.failed is None]
    tiers = TierReport(
        prompt_tokens=sum(q.prompt_len for q in ok),
        gpu_hit_tokens=sum(q.hit_gpu for q in ok),
        cpu_hit_tokens=sum(q.hit_cpu for q in ok),
        shared_hit_tokens=sum(q.hit_shared for q in ok),
    )
    read = sum(x.shared_read_bytes for x in replicas)
    write = sum(x.shared_write_bytes for x in replicas)
    peak = max((x.shared_read_bytes for x in replicas), default=0)
    network = NetworkReport(read, write, read * 8 / dur / 1e9, write * 8 / dur / 1e9, peak * 8 / dur / 1e9)
    tp = run.cost.preset.tp
    n_ok = max(summary.num_ok, 1)
    cost = run.config.num_replicas * tp * run.config.gpu_hour_usd * (dur / 3600.0) / (n_ok / 1000.0)
    return SimReport(
        label=label,
        run=bench_run,
        replicas=replicas,
        tiers=tiers,
        network=network,
        num_replicas=run.config.num_replicas,
        gpus_per_replica=tp,
        duration_s=run.duration_s,
        cost_per_1k_usd=cost,
        wall_s=run.wall_s,
        num_events=run.num_events,
        num_preemptions=sum(x.num_preemptions for x in replicas),
        ideal=run.ideal,
        stage_kv_peak=_stage_kv_peak(run, stages),
        flow=_flow(run),
    )


def _flow(run: FleetRun) -> FlowReport | None:
    flow = run.flow
    if flow is None:
        return None
    stats = flow.stats()
    return FlowReport(
        num_admitted=stats.num_admitted,
        num_queued=stats.num_queued,
        num_dispatched=stats.num_dispatched,
        num_shed=stats.num_shed_deadline + stats.num_shed_full,
        num_removed=stats.num_removed,
        wait=Dist.of(flow.waits),
    )


def _stage_kv_peak(run: FleetRun, stages: list[Summary]) -> list[float]:
    firsts: dict[int, float] = {}
    for q in run.requests:
        if q.arrival < firsts.get(q.stage, float("inf")):
            firsts[q.stage] = q.arrival
    starts = sorted(firsts.values())
    out = []
    for s in stages:
        lo = firsts.get(s.stage if s.stage is not None else -1)
        if lo is None:
            out.append(0.0)
            continue
        hi = next((t for t in starts if t > lo), float("inf"))
        out.append(max((max(u) for t, u in run.kv_samples if lo <= t < hi and u), default=0.0))
    return out


def _stage_itl(run: FleetRun, stages: list[Summary]) -> list[Dist]:
    """ITL per stage: decode steps that ended while the stage's requests were being sent."""
    values, weights, times = [], [], []
    for r in run.replicas:
        values.extend(r.stats.itl_values)
        weights.extend(r.stats.itl_weights)
        times.extend(r.stats.itl_times)
    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.int64)
    t = np.asarray(times, dtype=np.float64)
    windows: dict[int, tuple[float, float]] = {}
    for q in run.requests:
        lo, hi = windows.get(q.stage, (q.arrival, q.arrival))
        windows[q.stage] = (min(lo, q.arrival), max(hi, q.arrival))
    out = []
    for s in stages:
        lo, hi = windows.get(s.stage if s.stage is not None else -1, (0.0, -1.0))
        mask = (t >= lo) & (t <= hi)
        out.append(weighted_dist(v[mask], w[mask]))
    return out
