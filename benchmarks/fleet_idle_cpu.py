"""What an idle fleet costs: CPU of ``kvmesh demo``'s 8 emulated engines and their router, no traffic.

    .venv/bin/python benchmarks/fleet_idle_cpu.py [--settle 10] [--seconds 30] [--json out.json]

Starts the demo's emulated fleet (8 ``kvmesh engine --emulate`` pods with ZMQ KV events, the router
with its health checks and metrics scrapes), waits ``--settle`` seconds for start-up work to end,
then reads every fleet process's CPU seconds (its children included) over ``--seconds`` and reports
them as a share of one core: the fleet in all, the router, and the engines one by one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import psutil

from kvmesh.demo.run import DemoOptions, emulated_fleet_config
from kvmesh.fleet import Fleet


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


async def measure(settle_s: float, seconds: float, run_dir: Path) -> dict[str, object]:
    fleet = Fleet(emulated_fleet_config(DemoOptions(), run_dir))
    try:
        await fleet.start()
        await asyncio.sleep(settle_s)
        assert fleet.router is not None and fleet.router.pid is not None
        pids = {"router": fleet.router.pid}
        for n, engine in enumerate(fleet.engines):
            assert engine.process.pid is not None
            pids[f"engine {n}"] = engine.process.pid
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        elapsed = time.monotonic() - t0
        used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    finally:
        await fleet.aclose()
    per_process = {name: round(100 * s / elapsed, 2) for name, s in used.items()}
    engines = [v for k, v in per_process.items() if k.startswith("engine")]
    return {
        "engines": len(engines),
        "seconds": round(elapsed, 1),
        "fleet_pct_of_one_core": round(100 * sum(used.values()) / elapsed, 2),
        "router_pct": per_process["router"],
        "engine_pct_mean": round(sum(engines) / len(engines), 2),
        "engine_pct_max": max(engines),
        "per_process_pct": per_process,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after start-up before measuring")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds measured")
    parser.add_argument("--run-dir", type=Path, default=Path(f"/tmp/kvmesh-idle-{int(time.time())}"))
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args()
    report = asyncio.run(measure(args.settle, args.seconds, args.run_dir))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
