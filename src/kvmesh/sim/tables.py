"""Terminal tables the bench report does not have: fleet figures and simulated-vs-published."""

from __future__ import annotations

from collections.abc import Mapping

from rich.table import Table

from kvmesh.sim.presets import ScenarioPreset
from kvmesh.sim.report import SimReport


def fleet_table(reports: Mapping[str, SimReport]) -> Table:
    """Per run: hit rate by tier and against the ideal shared cache, utilisation, preemptions,
    shared-tier traffic and cost."""
    table = Table(title="fleet")
    for col in (
        "run", "GPU hit", "CPU hit", "shared hit", "ideal shared cache hit", "hit / ideal", "busy mean",
        "busy max", "KV use mean", "preempted", "shared read GB", "shared write GB", "$/1k req",
    ):  # fmt: skip
        table.add_column(col, justify="right")
    for label, rep in reports.items():
        rates = rep.tiers.rates()
        busy = [r.busy_frac for r in rep.replicas]
        kv = [r.kv_usage_mean for r in rep.replicas]
        share = rep.hit_rate_vs_ideal
        table.add_row(
            label,
            f"{rates['gpu']:.3f}",
            f"{rates['cpu']:.3f}",
            f"{rates['shared']:.3f}",
            f"{rep.ideal.hit_rate:.3f}",
            "-" if share is None else f"{share:.2f}",
            f"{sum(busy) / len(busy):.2f}",
            f"{max(busy):.2f}",
            f"{sum(kv) / len(kv):.2f}",
            str(rep.num_preemptions),
            f"{rep.network.read_bytes / 1e9:.1f}",
            f"{rep.network.write_bytes / 1e9:.1f}",
            f"{rep.cost_per_1k_usd:.3f}",
        )
    return table


def published_table(reports: Mapping[str, SimReport], scenario: ScenarioPreset) -> Table:
    """Simulated and published figures side by side, aggregated as the published table is."""
    how = "per-stage figures averaged" if scenario.aggregation == "stages" else "all requests pooled"
    table = Table(title=f"simulated vs published ({how})")
    for col in (
        "scheduler", "TTFT p90 sim", "TTFT p90 pub", "ratio", "out tok/s sim", "out tok/s pub", "ratio",
    ):  # fmt: skip
        table.add_column(col, justify="right")
    for label, rep in reports.items():
        pub = scenario.published.get(label)
        if pub is None:
            continue
        h = scenario.headline(rep)
        table.add_row(
            label,
            f"{h.ttft_p90_s:.3f}",
            f"{pub.ttft_p90_s:.3f}",
            f"{h.ttft_p90_s / pub.ttft_p90_s:.2f}",
            f"{h.output_tok_s:.0f}",
            f"{pub.output_tok_s:.0f}",
            f"{h.output_tok_s / pub.output_tok_s:.2f}",
        )
    return table
