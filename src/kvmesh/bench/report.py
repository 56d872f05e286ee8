"""Reports of benchmark runs: terminal tables (rich), JSON, and PNG plots (matplotlib, Agg backend).

The comparison table has llm-d's columns: scheduler, output tok/s, req/s, TTFT p90, TTFT mean,
ITL mean, wait-queue mean, plus the hit rate.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvmesh.bench.metrics import RunResult, Summary


def make_console() -> Console:
    """A console for reports: the terminal's width, or 160 columns when writing to a file or pipe."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    return console


def _s(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.2f}"


def summary_table(run: RunResult, *, title: str | None = None) -> Table:
    """The run as one row per stage plus a total row."""
    table = Table(title=title or f"{run.label} · {run.workload}")
    for col in (
        "stage",
        "QPS",
        "ok/sent",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "TPOT mean",
        "ITL mean",
        "E2E p90",
        "queue",
        "hit rate",
    ):
        table.add_column(col, justify="right")

    def row(name: str, s: Summary) -> list[str]:
        return [
            name,
            f"{s.offered_rate:g}" if s.offered_rate is not None else "-",
            f"{s.num_ok}/{s.num_requests}",
            f"{s.request_throughput:.2f}",
            f"{s.output_throughput:.1f}",
            _s(s.ttft.median),
            _s(s.ttft.p90),
            _s(s.ttft.p99),
            _s(s.tpot.mean),
            _s(s.itl.mean),
            _s(s.e2e.p90),
            f"{s.queue_mean:.1f}",
            f"{s.hit_rate:.2f}",
        ]

    if len(run.stages) > 1:
        for s in run.stages:
            table.add_row(*row(f"{s.stage} (warm-up)" if s.stage in run.warmup_stages else str(s.stage), s))
    table.add_row(*row("measured" if run.warmup_stages else "all", run.summary), style="bold")
    return table


SummaryColumn = tuple[str, Callable[[Summary], str]]
"""A table column: its header, and the cell it shows for a run's summary."""


def runs_table(
    runs: Mapping[str, RunResult], columns: Sequence[SummaryColumn], *, title: str, label_header: str
) -> Table:
    """One row per labelled run: the label under ``label_header``, then each column's cell."""
    table = Table(title=title)
    for header in (label_header, *(header for header, _ in columns)):
        table.add_column(header, justify="right")
    for label, run in runs.items():
        table.add_row(label, *(cell(run.summary) for _, cell in columns))
    return table


def compare_table(runs: Mapping[str, RunResult], *, title: str = "scheduler comparison") -> Table:
    """llm-d's comparison table, one row per labelled run (a ``shed`` column when a router's flow
    control refused requests: those are not in ``failed``, and latencies are over completed ones)."""
    columns: list[SummaryColumn] = [
        ("output tok/s", lambda s: f"{s.output_throughput:.1f}"),
        ("req/s", lambda s: f"{s.request_throughput:.2f}"),
        ("TTFT p90 s", lambda s: _s(s.ttft.p90)),
        ("TTFT mean s", lambda s: _s(s.ttft.mean)),
        ("ITL mean s", lambda s: _s(s.itl.mean)),
        ("queue mean", lambda s: f"{s.queue_mean:.1f}"),
        ("hit rate", lambda s: f"{s.hit_rate:.3f}"),
        ("failed", lambda s: str(s.num_failed)),
    ]
    if any(run.summary.num_shed for run in runs.values()):
        columns.append(("shed (429)", lambda s: str(s.num_shed)))
    table = runs_table(runs, columns, title=title, label_header="scheduler")
    if any(run.warmup_stages for run in runs.values()):
        table.caption = "warm-up stage excluded"
    return table


def print_runs(
    runs: Mapping[str, RunResult], console: Console | None = None, *, per_stage: bool = True
) -> None:
    console = console or make_console()
    if per_stage:
        for run in runs.values():
            console.print(summary_table(run))
    if len(runs) > 1:
        console.print(compare_table(runs))


def runs_to_json(runs: Mapping[str, RunResult], *, include_requests: bool = False) -> dict[str, Any]:
    return {label: run.to_dict(include_requests=include_requests) for label, run in runs.items()}


def write_json(path: str | Path, runs: Mapping[str, RunResult], *, include_requests: bool = False) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(runs_to_json(runs, include_requests=include_requests), indent=2))
    return path


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(runs: Mapping[str, RunResult], path: str | Path, *, title: str = "TTFT CDF") -> Path:
    """One TTFT CDF line per run (log-scale x)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, run in runs.items():
        ttfts = np.sort([r.ttft_s for r in run.results if r.ok and r.ttft_s is not None])
        if ttfts.size == 0:
            continue
        ax.plot(ttfts, np.arange(1, ttfts.size + 1) / ttfts.size, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(plt, fig, path)


def save_figure(plt: Any, fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` as a PNG (its folder made if needed), close it, return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_stage_curves(
    runs: Mapping[str, RunResult], path: str | Path, *, title: str = "p90 TTFT and throughput vs QPS"
) -> Path:
    """p90 TTFT (log) and output throughput against each stage's offered QPS, one line per run."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, run in runs.items():
        pts = sorted(
            ((s.offered_rate, s) for s in run.stages if s.offered_rate is not None and s.num_ok),
            key=lambda p: p[0],
        )
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ax1.plot(xs, [max(p[1].ttft.p90, 1e-4) for p in pts], marker="o", label=label)
        ax2.plot(xs, [p[1].output_throughput for p in pts], marker="o", label=label)
    ax1.set_yscale("log")
    ax1.set_xlabel("offered QPS")
    ax1.set_ylabel("TTFT p90 (s)")
    ax2.set_xlabel("offered QPS")
    ax2.set_ylabel("output tokens/s")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(plt, fig, path)


def describe_ratio(ratio: float, what: str, better: str, worse: str) -> str:
    """``"p90 TTFT 3.1x lower"`` for ratio 3.1, ``"p90 TTFT 1.3x higher"`` for ratio 0.77."""
    if ratio >= 1 or ratio == 0:
        return f"{what} {ratio:.1f}x {better}"
    return f"{what} {1 / ratio:.1f}x {worse}"


def ratio_lines(runs: Mapping[str, RunResult], best: str, baselines: Sequence[str]) -> list[str]:
    """Sentences comparing ``best`` with each baseline on p90 TTFT and output throughput."""
    out: list[str] = []
    if best not in runs:
        return out
    b = runs[best].summary
    for name in baselines:
        if name not in runs or name == best:
            continue
        o = runs[name].summary
        ttft = o.ttft.p90 / b.ttft.p90 if b.ttft.p90 else float("inf")
        thr = b.output_throughput / o.output_throughput if o.output_throughput else float("inf")
        out.append(
            f"{best} vs {name}: {describe_ratio(ttft, 'p90 TTFT', 'lower', 'higher')}, output throughput {thr:.2f}x"
        )
    return out
