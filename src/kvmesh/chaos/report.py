"""The run's report: a rich table on the terminal, a JSON file and a timeline PNG.

::

    out_dir/
      chaos-report.json     every scenario's bounds and figures, the faults, the per-second series
      chaos-timeline.png    requests/s, errors, hit rate and p90 TTFT over time, faults shaded
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from kvmesh.bench.report import pyplot, save_figure
from kvmesh.chaos.bounds import ScenarioResult
from kvmesh.chaos.load import Series
from kvmesh.chaos.schedule import FaultSpan

JSON_NAME = "chaos-report.json"
PNG_NAME = "chaos-timeline.png"


@dataclass(slots=True)
class ChaosReport:
    """Everything one ``kvmesh chaos`` run measured."""

    mode: str
    command: str
    started_at: str
    fleet: dict[str, Any]
    scenarios: list[ScenarioResult] = field(default_factory=list)
    faults: list[FaultSpan] = field(default_factory=list)
    series: Series | None = None
    duration_s: float = 0.0
    load: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.scenarios) and all(s.passed for s in self.scenarios)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "command": self.command,
            "started_at": self.started_at,
            "duration_s": round(self.duration_s, 1),
            "passed": self.passed,
            "fleet": self.fleet,
            "load": self.load,
            "scenarios": [s.to_dict() for s in self.scenarios],
            "faults": [asdict(f) for f in self.faults],
            "series": _finite(asdict(self.series)) if self.series is not None else None,
        }


def _finite(value: Any) -> Any:
    """``nan`` (no sample in a bin) as JSON ``null``."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_json(report: ChaosReport, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(report.to_dict()), indent=2, default=str) + "\n")
    return path


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.3g}"
    return str(value)


def render_table(report: ChaosReport) -> Table:
    """One row per bound (scenario name on its first row), then the scenario's figures."""
    table = Table(title=f"kvmesh chaos ({report.mode}, {report.duration_s:.0f} s)", show_lines=True)
    table.add_column("scenario")
    table.add_column("bound")
    table.add_column("measured", justify="right")
    table.add_column("")
    table.add_column("figures")
    for s in report.scenarios:
        figures = ", ".join(f"{k}={_fmt(v)}" for k, v in s.figures.items())
        if s.error is not None:
            table.add_row(s.title, "[red]error[/red]", "", "[red]FAIL[/red]", s.error)
            continue
        for n, b in enumerate(s.bounds or []):
            verdict = "[green]ok[/green]" if b.passed else "[red]FAIL[/red]"
            table.add_row(s.title if n == 0 else "", b.name, b.describe(), verdict, figures if n == 0 else "")
    return table


def plot_timeline(report: ChaosReport, path: Path) -> Path:
    """Four stacked panels sharing the time axis, each fault a labelled shaded span."""
    plt = pyplot()
    s = report.series
    if s is None:
        raise ValueError("the report has no series to plot")
    panels = (
        ("requests/s", s.requests_per_s, "tab:blue"),
        ("failed requests", s.errors, "tab:red"),
        ("hit rate", s.hit_rate, "tab:green"),
        ("p90 TTFT (s)", s.p90_ttft_s, "tab:purple"),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 8.5), sharex=True)
    for ax, (label, values, color) in zip(axes, panels, strict=True):
        if label == "failed requests":
            ax.bar(s.t_s, values, width=s.bin_s, align="edge", color=color)
        else:
            ax.plot([t + s.bin_s / 2 for t in s.t_s], values, color=color, linewidth=1.2)
        ax.set_ylabel(label)
        if label.startswith("p90 TTFT"):
            ax.set_yscale("log")  # a 1 s stall next to a 15 ms baseline
        ax.grid(alpha=0.3)
        for k, f in enumerate(report.faults):
            ax.axvspan(f.start_s, f.end_s, color=f"C{k % 10}", alpha=0.18)
    top = axes[0]
    ymax = top.get_ylim()[1]
    for k, f in enumerate(report.faults):
        top.text(
            f.start_s, ymax, f" {f.name}", rotation=30, fontsize=7, va="bottom", ha="left", color=f"C{k % 10}"
        )
    axes[-1].set_xlabel("seconds since start")
    verdict = "all bounds hold" if report.passed else "BOUNDS FAILED"
    fig.suptitle(f"kvmesh chaos ({report.mode}): {verdict}", y=0.995)
    fig.tight_layout()
    return save_figure(plt, fig, path)
