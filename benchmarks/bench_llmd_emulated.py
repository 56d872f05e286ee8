"""Reproduce llm-d's 73-capacity scheduler comparison on an emulated 8-pod fleet and check its claims.

Runs ``llmd-73-scaled`` (see ``kvmesh.bench.presets``) once per scheduler on one fleet of 8 engines
emulating Qwen3-32B TP2 on H100, then checks what llm-d published about the ordering:

- p90 TTFT: precise < approximate < load ≈ random (load and random within 2x of each other);
- precise p90 TTFT at least 100x lower than random's;
- precise output throughput at least 1.8x random's.

Usage::

    .venv/bin/python benchmarks/bench_llmd_emulated.py --out-dir docs --json llmd.json

writes ``bench_llmd_ttft_cdf.png`` and ``bench_llmd_vs_qps.png`` into ``--out-dir`` and exits 1 when a
claim does not hold.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from kvmesh.bench.compare import compare_policies
from kvmesh.bench.metrics import RunResult
from kvmesh.bench.presets import llmd_73_scaled
from kvmesh.bench.report import (
    make_console,
    plot_stage_curves,
    plot_ttft_cdf,
    print_runs,
    ratio_lines,
    write_json,
)
from kvmesh.bench.runner import RunOptions
from kvmesh.fleet import Fleet, FleetConfig

POLICIES = ("random", "load", "approximate", "precise")


def check_claims(runs: dict[str, RunResult]) -> list[tuple[str, bool]]:
    """llm-d's published ordering and ratios, each with whether it holds in ``runs``."""
    p90 = {k: r.summary.ttft.p90 for k, r in runs.items()}
    thr = {k: r.summary.output_throughput for k, r in runs.items()}
    lo, hi = sorted((p90["load"], p90["random"]))
    return [
        ("p90 TTFT precise < approximate", p90["precise"] < p90["approximate"]),
        ("p90 TTFT approximate < min(load, random)", p90["approximate"] < lo),
        ("p90 TTFT load ≈ random (within 2x)", hi <= 2 * lo),
        (f"precise p90 ≥ 100x lower than random ({p90['random'] / p90['precise']:.0f}x)", p90["random"] >= 100 * p90["precise"]),
        (f"precise throughput ≥ 1.8x random ({thr['precise'] / thr['random']:.2f}x)", thr["precise"] >= 1.8 * thr["random"]),
    ]  # fmt: skip


async def run(size: str, run_dir: Path | None) -> tuple[str, dict[str, RunResult]]:
    scaled = llmd_73_scaled(size)  # type: ignore[arg-type]
    config = FleetConfig(
        num_engines=scaled.num_engines,
        model="smollm2",
        emulate=scaled.emulate,
        shared="none",
        policy=POLICIES[0],
        engine_args=["--kv-capacity-tokens", str(scaled.kv_capacity_tokens)],
        run_dir=run_dir,
    )
    async with Fleet(config) as fleet:
        opts = RunOptions(base_url=fleet.url, model="", progress=sys.stderr.isatty())
        runs = await compare_policies(
            fleet, scaled.workload, POLICIES, opts, scheduler_configs=scaled.scheduler_configs
        )
    return scaled.description, runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=["full", "demo", "quick"], default="full")
    p.add_argument("--out-dir", type=Path, default=Path("."), help="where the PNG plots go")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--run-dir", type=Path, default=None)
    args = p.parse_args()
    console = make_console()
    description, runs = asyncio.run(run(args.size, args.run_dir))
    console.print(description)
    print_runs(runs, console)
    for line in ratio_lines(runs, "precise", ["random", "load", "approximate"]):
        console.print(line)
    if args.json is not None:
        write_json(args.json, runs)
    plot_ttft_cdf(
        runs, args.out_dir / "bench_llmd_ttft_cdf.png", title="TTFT CDF, emulated llm-d 73-capacity (scaled)"
    )
    plot_stage_curves(
        runs,
        args.out_dir / "bench_llmd_vs_qps.png",
        title="emulated llm-d 73-capacity (scaled): p90 TTFT and throughput",
    )
    ok = True
    for claim, holds in check_claims(runs):
        console.print(f"{'PASS' if holds else 'FAIL'}  {claim}")
        ok &= holds
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
