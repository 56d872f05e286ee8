"""Capacity sweeps: the same workload over fleet sizes and loads, with and without a shared tier.

For every ``(replicas, qps)`` point the workload's load stages are replaced by one stage of ``qps``
for ``duration_s``, and the fleet is simulated twice: device caches only, and with a shared store
behind a ``net_gbps`` network. The result answers "how many replicas, and is sharing worth it" as
two curves per load: p90 TTFT and GPU cost per 1k requests against fleet size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.bench.report import pyplot, save_figure
from kvmesh.errors import ConfigError
from kvmesh.sim.fleet import FleetConfig, simulate
from kvmesh.sim.report import SimReport, build_report
from kvmesh.workload import Stage, Workload


@dataclass(slots=True)
class SweepPoint:
    """One simulated fleet of the sweep."""

    replicas: int
    qps: float | None
    shared: bool
    report: SimReport

    def row(self) -> dict[str, Any]:
        s = self.report.summary
        return {
            "replicas": self.replicas,
            "qps": self.qps,
            "shared": self.shared,
            "ttft_p90_s": s.ttft.p90,
            "ttft_mean_s": s.ttft.mean,
            "e2e_p90_s": s.e2e.p90,
            "output_tok_s": s.output_throughput,
            "req_s": s.request_throughput,
            "hit_rate": s.hit_rate,
            "hit_rate_by_tier": self.report.tiers.rates(),
            "cost_per_1k_usd": self.report.cost_per_1k_usd,
            "shared_read_gbps": self.report.network.read_gbps_mean,
            "failed": s.num_failed,
        }


def with_rate(workload: Workload, qps: float, duration_s: float) -> Workload:
    """``workload`` with its load stages replaced by one stage of ``qps`` for ``duration_s``.

    Raises:
        ConfigError: the workload has no load stages to replace (a trace, multi-turn).
    """
    if not dataclasses.is_dataclass(workload) or not hasattr(workload, "stages"):
        raise ConfigError(
            f"workload {getattr(workload, 'name', workload)!r} has no load stages; sweep it without --qps"
        )
    return dataclasses.replace(workload, stages=[Stage(qps, duration_s)])


def run_sweep(
    base: FleetConfig,
    workload: Workload,
    replicas: Sequence[int],
    qps: Sequence[float] | None,
    *,
    duration_s: float = 120.0,
    shared_tier: str = "redis",
    on_point: Callable[[SweepPoint], None] | None = None,
) -> list[SweepPoint]:
    """Simulate every (replicas, qps) point without and with the shared tier."""
    points: list[SweepPoint] = []
    loads: list[float | None] = list(qps) if qps else [None]
    for rate in loads:
        wl = workload if rate is None else with_rate(workload, rate, duration_s)
        for n in replicas:
            for shared in (False, True):
                cfg = dataclasses.replace(base, num_replicas=n, shared_tier=shared_tier if shared else None)
                label = f"{n}x{'' if rate is None else f'@{rate:g}qps'}{'+shared' if shared else ''}"
                point = SweepPoint(n, rate, shared, build_report(simulate(cfg, wl), label))
                points.append(point)
                if on_point is not None:
                    on_point(point)
    return points


def plot_sweep(points: Sequence[SweepPoint], path: str | Path, *, title: str = "fleet size sweep") -> Path:
    """p90 TTFT (log) and cost per 1k requests against fleet size, one line per (qps, sharing)."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    series: dict[tuple[float | None, bool], list[SweepPoint]] = {}
    for p in points:
        series.setdefault((p.qps, p.shared), []).append(p)
    for (rate, shared), pts in sorted(series.items(), key=lambda kv: (kv[0][0] or 0.0, kv[0][1])):
        pts = sorted(pts, key=lambda p: p.replicas)
        label = ("" if rate is None else f"{rate:g} req/s, ") + ("shared tier" if shared else "no sharing")
        style = "-" if shared else "--"
        xs = [p.replicas for p in pts]
        ax1.plot(xs, [max(p.report.summary.ttft.p90, 1e-4) for p in pts], style, marker="o", label=label)
        ax2.plot(xs, [p.report.cost_per_1k_usd for p in pts], style, marker="o", label=label)
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT p90 (s)")
    ax2.set_ylabel("GPU cost per 1k requests (USD)")
    for ax in (ax1, ax2):
        ax.set_xlabel("replicas")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(plt, fig, path)
