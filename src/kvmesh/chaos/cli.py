"""``kvmesh chaos``: the fault-and-soak harness (see :mod:`kvmesh.chaos`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    from kvmesh.chaos.harness import SCENARIOS

    p = subparsers.add_parser(
        "chaos",
        help="fault-and-soak run of a local fleet under load, with a pass/fail report",
        description=(
            "Start a fleet (two CPU engines of a tiny model, router, Redis or Valkey), drive steady load through the "
            "router, inject faults (shared tier killed and frozen, an engine killed, the router "
            "restarted, corrupt chunks, fuzzed events and requests, two tenants, an overload burst through "
            "flow control, a soak, a rolling restart of two router workers and then of every engine) and check each scenario's bounds. Exit code 1 when any bound fails."
        ),
    )
    p.add_argument("--quick", action="store_true", help="the short run (about 4 minutes; 30 s soak)")
    p.add_argument("--shared", choices=["redis", "valkey"], default="redis", help="shared tier server")
    p.add_argument("--out", type=Path, default=Path("chaos-report"), help="report, timeline and fleet logs")
    p.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIOS,
        help="run only this scenario (repeatable; default all)",
    )
    p.add_argument("--rate", type=float, default=12.0, help="steady load, requests per second")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvmesh.chaos.bounds import ScenarioResult
    from kvmesh.chaos.harness import SCENARIOS, ChaosConfig, run
    from kvmesh.chaos.report import JSON_NAME, PNG_NAME, plot_timeline, render_table, write_json
    from kvmesh.errors import FleetError

    console = Console()
    config = ChaosConfig(
        quick=args.quick,
        shared=args.shared,
        out_dir=args.out,
        scenarios=tuple(args.scenario or SCENARIOS),
        rate=args.rate,
    )

    def done(result: ScenarioResult) -> None:
        verdict = "[green]pass[/green]" if result.passed else "[red]FAIL[/red]"
        console.print(
            f"{verdict} {result.title} ({result.duration_s:.1f} s)"
            + (f": {result.error}" if result.error else "")
        )

    try:
        report = run(config, done)
    except FleetError as exc:
        console.print(f"[red]fleet failed:[/red] {exc}")
        return 1
    console.print(render_table(report))
    json_path = write_json(report, args.out / JSON_NAME)
    png_path = plot_timeline(report, args.out / PNG_NAME)
    console.print(f"report {json_path}, timeline {png_path}")
    return 0 if report.passed else 1
