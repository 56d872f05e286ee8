"""``kvmesh demo`` run several times, each a fresh process: the median and range of every figure.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/demo_runs.py --runs 3 --out-dir /tmp/demo-runs [--json]
    .venv/bin/python benchmarks/demo_runs.py --from-dir /tmp/demo-runs          # summarize runs made before

Each run is ``kvmesh demo --json OUT/runK.json --run-dir OUT/dirK`` (both parts: two real vLLM
fleets and the emulated llm-d fleet, or only what ``--demo-args`` asks for). One run's tail is a
handful of requests, so what README quotes is the median over runs with the lowest and highest
value beside it; every ratio is taken within a run (two fleets measured in the same minutes) and
then summarized, never a median divided by a median.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REAL_SETUPS = ("round-robin, vLLM prefix cache", "kvmesh router + shared store")
EMULATED_BASELINES = ("random", "load", "approximate", "llmd-precise")


def run_demos(runs: int, out_dir: Path, demo_args: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="160")
    for k in range(1, runs + 1):
        started = time.monotonic()
        print(f"run {k}/{runs} ...", file=sys.stderr, flush=True)
        with (out_dir / f"run{k}.log").open("w") as log:
            proc = subprocess.run(
                [sys.executable, "-m", "kvmesh", "demo", "--json", str(out_dir / f"run{k}.json"),
                 "--run-dir", str(out_dir / f"dir{k}"), *demo_args],
                stdout=log, stderr=subprocess.STDOUT, env=env, check=False,
            )  # fmt: skip
        print(f"run {k}/{runs}: exit {proc.returncode}, {time.monotonic() - started:.0f} s", file=sys.stderr)
        if proc.returncode != 0:
            raise SystemExit(f"kvmesh demo failed; see {out_dir / f'run{k}.log'}")


def load_runs(out_dir: Path) -> list[dict[str, Any]]:
    """Per run: {"real": {...}, "probe": {...}, "emulated": {...}} for the parts it wrote."""
    runs = []
    for k in range(1, 1000):
        parts = {
            part: json.loads(path.read_text())
            for part in ("real", "probe", "emulated")
            if (path := out_dir / f"run{k}-{part}.json").exists()
        }
        if not parts:
            break
        runs.append(parts)
    return runs


def figures(run: dict[str, Any]) -> dict[str, float]:
    """The figures README quotes, for one run."""
    out: dict[str, float] = {}
    real = run.get("real")
    if real and all(s in real for s in REAL_SETUPS):
        rr, km = (real[s]["summary"] for s in REAL_SETUPS)
        for name, s in (("rr", rr), ("kvmesh", km)):
            out[f"real {name} reusable from cache"] = s["reusable_hit_rate"]
            out[f"real {name} ttft p50 s"] = s["ttft"]["median"]
            out[f"real {name} ttft p90 s"] = s["ttft"]["p90"]
            out[f"real {name} req/s"] = s["request_throughput"]
        out["real p50 lower x"] = rr["ttft"]["median"] / km["ttft"]["median"]
        out["real p90 lower x"] = rr["ttft"]["p90"] / km["ttft"]["p90"]
        out["real throughput x"] = km["request_throughput"] / rr["request_throughput"]
    probe = run.get("probe")
    if probe:
        out["probe cold ttft s"] = probe["cold_ttft_s"]
        out["probe from store ttft s"] = probe["loaded_ttft_s"]
        out["probe speed-up x"] = probe["cold_ttft_s"] / probe["loaded_ttft_s"]
        out["probe same first token"] = float(probe["same_first_token"])
    emulated = run.get("emulated")
    if emulated and "precise" in emulated:
        p90 = {policy: r["summary"]["ttft"]["p90"] for policy, r in emulated.items()}
        out["emulated precise p90 s"] = p90["precise"]
        out["emulated precise hit"] = emulated["precise"]["summary"]["hit_rate"]
        for base in EMULATED_BASELINES:
            if base in p90:
                out[f"emulated {base} p90 s"] = p90[base]
                out[f"emulated {base} p90 / precise x"] = p90[base] / p90["precise"]
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    per_run = [figures(r) for r in runs]
    names = [n for n in per_run[0] if all(n in f for f in per_run)] if per_run else []
    return {
        n: {
            "median": statistics.median(f[n] for f in per_run),
            "min": min(f[n] for f in per_run),
            "max": max(f[n] for f in per_run),
            "runs": len(per_run),
        }
        for n in names
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/kvmesh-demo-runs"))
    parser.add_argument(
        "--from-dir", type=Path, help="summarize the runs already in this folder; run nothing"
    )
    parser.add_argument("--demo-args", default="", help="extra arguments for kvmesh demo (quoted)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out_dir = args.from_dir or args.out_dir
    if args.from_dir is None:
        run_demos(args.runs, out_dir, shlex.split(args.demo_args))
    runs = load_runs(out_dir)
    if not runs:
        raise SystemExit(f"no run*-real.json / run*-emulated.json under {out_dir}")
    summary = summarize(runs)
    if args.json:
        json.dump({"runs": len(runs), "figures": summary}, sys.stdout, indent=2)
        print()
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvmesh demo, {len(runs)} fresh runs: median (min–max)")
    for col in ("figure", "median", "range"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for name, s in summary.items():
        table.add_row(name, f"{s['median']:.3g}", f"{s['min']:.3g}–{s['max']:.3g}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
