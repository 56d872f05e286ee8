"""``kvmesh demo``: the one-command demonstration."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    demo = subparsers.add_parser("demo", help="real-model fleet and emulated llm-d comparison, end to end")
    demo.add_argument("--quick", action="store_true", help="about one minute instead of about six")
    demo.add_argument(
        "--replicas", type=int, default=None, help="real-model replicas (default 4; 3 with --quick)"
    )
    demo.add_argument(
        "--engine",
        choices=["vllm", "kvmesh"],
        default=None,
        help="real-model replicas: vllm (default where vLLM runs) or the kvmesh reference engine",
    )
    demo.add_argument("--skip-real", action="store_true", help="only the emulated llm-d comparison")
    demo.add_argument("--skip-emulated", action="store_true", help="only the real-model comparison")
    demo.add_argument("--run-dir", type=Path, default=None, help="logs and shared tier (default: temp dir)")
    demo.add_argument("--json", dest="json_path", type=Path, default=None, help="write all results here")
    demo.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here")
    demo.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvmesh.bench.report import make_console
    from kvmesh.demo.run import DemoOptions, run_demo

    options = DemoOptions(
        quick=args.quick,
        replicas=args.replicas,
        real=not args.skip_real,
        emulated=not args.skip_emulated,
        run_dir=args.run_dir,
        json_path=args.json_path,
        plot_dir=args.plot_dir,
        engine=args.engine,
    )
    return asyncio.run(run_demo(options, make_console()))
