"""Coding-agent sessions at the knee and at twice it, with and without the router's flow control.

    .venv/bin/python benchmarks/sim_overload.py [--json out.json]

The simulator (the router's own scheduler, flow control and index in virtual time) on 8 × Qwen3-32B
TP2 H100 pods with a 1M-token CPU tier each and 64-token blocks, the default routing profile, the
agentic example (``src/kvmesh/sim/examples/agentic.yaml``) with 32 sessions 4 s apart (1×) and 64
sessions 2 s apart (2×), clients waiting up to 900 s. Flow control: off; the defaults (10 s
predicted-TTFT bound, 15 s deadline, work the fleet holds going first: ``continuationShare`` 0.9),
and without that order (0); a 30 s deadline; a 5 s bound with a 20 s deadline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvmesh.router.flow_control import FlowControlConfig
from kvmesh.sim.fleet import FleetConfig, simulate
from kvmesh.sim.report import build_report
from kvmesh.workload import AgenticWorkload, load_workload

AGENTIC_YAML = Path(__file__).resolve().parent.parent / "src" / "kvmesh" / "sim" / "examples" / "agentic.yaml"
LOADS = (1.0, 2.0)
SETTINGS: list[tuple[str, FlowControlConfig | None]] = [
    ("off", None),
    ("10 s / 15 s, continuing first (default)", FlowControlConfig()),
    ("10 s / 15 s, FIFO", FlowControlConfig(continuation_share=0.0)),
    ("10 s / 30 s, continuing first", FlowControlConfig(max_queue_wait_seconds=30)),
    ("5 s / 20 s, continuing first", FlowControlConfig(max_predicted_ttft_seconds=5, max_queue_wait_seconds=20)),
]  # fmt: skip


def agentic(load: float) -> AgenticWorkload:
    """The example's sessions, ``32 × load`` of them starting ``4 / load`` s apart."""
    base = load_workload(AGENTIC_YAML)
    assert isinstance(base, AgenticWorkload), "the agentic example builds an agentic workload"
    return dataclasses.replace(base, num_sessions=round(32 * load), session_interval_s=4 / load)


def run(load: float, flow: FlowControlConfig | None) -> dict[str, Any]:
    config = FleetConfig(
        num_replicas=8,
        model_preset="qwen3-32b-h100-tp2",
        policy="precise",
        block_size=64,
        cpu_tier_tokens=1_000_000,
        flow_control=flow,
        request_timeout_s=900,
    )
    s = build_report(simulate(config, agentic(load))).run.summary
    return {
        "served": s.num_ok,
        "shed": s.num_shed,
        "timeouts": s.num_timeouts,
        "hit_rate": s.hit_rate,
        "ttft_p50_s": s.ttft.median,
        "ttft_p90_s": s.ttft.p90,
        "ttft_p99_s": s.ttft.p99,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        task = progress.add_task("simulating", total=len(SETTINGS) * len(LOADS))
        for name, flow in SETTINGS:
            for load in LOADS:
                progress.update(task, description=f"{name}, {load:g}×")
                rows.append({"flow_control": name, "load": load, **run(load, flow)})
                progress.advance(task)
    table = Table(title="agentic sessions, + CPU tier: flow control at 1× and 2×")
    for col in ("flow control", "load", "served", "shed (429)", "timeouts", "hit", "TTFT p50 · p90 · p99 s"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["flow_control"], f"{r['load']:g}×", str(r["served"]), str(r["shed"]), str(r["timeouts"]),
            f"{r['hit_rate']:.3f}", f"{r['ttft_p50_s']:.2f} · {r['ttft_p90_s']:.2f} · {r['ttft_p99_s']:.2f}",
        )  # fmt: skip
    Console().print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
