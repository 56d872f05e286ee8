"""``kvmesh up``: a local fleet until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def register(subparsers: Any) -> None:
    up = subparsers.add_parser("up", help="start engines + router + shared tier on this machine until Ctrl-C")
    up.add_argument(
        "--engines",
        type=int,
        default=2,
        dest="num_engines",
        metavar="ENGINES",
        help="engine replicas (default 2)",
    )
    up.add_argument(
        "--model", default="smollm2", help="engine --model (smollm2, tiny-random-llama, a directory)"
    )
    up.add_argument(
        "--engine",
        choices=["kvmesh", "vllm"],
        default="kvmesh",
        help="kvmesh reference engines (default) or real vLLM servers (CPU build, .venv-vllm; "
        "--engine-arg then takes vLLM flags)",
    )
    up.add_argument("--emulate", default=None, help="engine --emulate PRESET (no tensors, GPU cost model)")
    up.add_argument(
        "--shared",
        choices=["dir", "redis", "valkey", "none"],
        default="dir",
        help="shared tier: a directory under the run dir (default), a redis-server or valkey-server, or none",
    )
    up.add_argument(
        "--emulated-store",
        action="store_true",
        help="emulated engines use the shared tier too (placeholder KV, modelled load times)",
    )
    up.add_argument("--policy", default="precise", help="router --policy (default precise)")
    up.add_argument("--router-config", default=None, help="router YAML (replaces --policy)")
    up.add_argument("--port", type=int, default=8000, help="router port (default 8000; 0 = any free port)")
    up.add_argument("--no-router", action="store_true", help="start engines and the shared tier only")
    up.add_argument("--engine-arg", action="append", default=[], help="extra engine flags (quoted)")
    up.add_argument("--router-arg", action="append", default=[], help="extra router flags (quoted)")
    up.add_argument(
        "--run-dir", type=Path, default=None, help="logs, fleet.json, shared dir (default: temp dir)"
    )
    up.add_argument(
        "--health-timeout",
        type=float,
        default=300.0,
        dest="health_timeout_s",
        metavar="HEALTH_TIMEOUT",
        help="seconds to wait for each process",
    )
    up.set_defaults(func=_cmd_up)


def _fleet_table(fleet: Any) -> Table:
    table = Table(title=f"kvmesh fleet · {fleet.run_dir}")
    table.add_column("process")
    table.add_column("URL")
    table.add_column("events")
    table.add_column("log")
    if fleet.router_url:
        table.add_row(f"router ({fleet.router_policy})", fleet.router_url, "", str(fleet.router.log_path))
    for e in fleet.engines:
        events = e.events_endpoint or ""
        if e.replay_endpoint:
            events += f" (replay {e.replay_endpoint})"
        table.add_row(e.process.name, e.url, events, str(e.process.log_path))
    table.add_row("shared tier", fleet.store_url or "(none)", "", "")
    return table


def _cmd_up(args: argparse.Namespace) -> int:
    from kvmesh.core.cli_options import options_from_args
    from kvmesh.errors import FleetError
    from kvmesh.fleet.config import FleetConfig, split_args
    from kvmesh.fleet.launcher import Fleet

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # the fleet table's log paths stay on one line in a file or pipe
    config = options_from_args(
        FleetConfig,
        args,
        start_router=not args.no_router,
        router_port=args.port or None,
        engine_args=split_args(args.engine_arg),
        router_args=split_args(args.router_arg),
    )

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        fleet = Fleet(config)
        start = asyncio.create_task(fleet.start())
        stopper = asyncio.create_task(stop.wait())
        try:
            with console.status(f"starting {config.num_engines} engines, router and shared tier ..."):
                done, _ = await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if start not in done:
                start.cancel()
                with contextlib.suppress(asyncio.CancelledError, FleetError):
                    await start
                console.print("interrupted before the fleet was up; stopped")
                return 130
            start.result()
            console.print(_fleet_table(fleet))
            console.print(f"send OpenAI requests to [bold]{fleet.url}[/bold]; Ctrl-C stops everything")
            while not stop.is_set():
                try:
                    fleet.check_alive()
                except FleetError as exc:
                    console.print(f"[red]{exc}[/red]")
                    return 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
            console.print("stopping ...")
            return 0
        except FleetError as exc:
            console.print(f"[red]{exc}[/red]")
            return 1
        finally:
            stopper.cancel()
            await fleet.aclose()

    return asyncio.run(main())
