"""Memory and time of a whole Mooncake trace (or any workload YAML) through the simulator, one
process per policy.

    .venv/bin/python benchmarks/sim_trace_memory.py [--trace benchmarks/traces/mooncake_conversation_trace.jsonl.gz]
        [--workload src/kvmesh/sim/examples/agentic.yaml]
        [--policies precise,load,random,approximate] [--replicas 8] [--model-preset qwen3-32b-h100-tp2]
        [--block-size 64] [--kv-capacity-tokens N] [--cpu-tier-tokens N] [--shared-tier redis]
        [--shared-capacity-tokens N] [--speedup 1] [--max-requests N] [--json out.json]

Each policy runs in a fresh interpreter (``spawn``), so its peak RSS (``ru_maxrss``) is its own:
imports, the trace replay, the fleet's caches and the router's index, and the report. Prints, per
policy: peak RSS, wall and CPU seconds (simulation plus report), prompt-token hit rate, the ideal
shared cache's hit rate (one LRU prefix cache of the fleet's total KV fed the same requests) and the
hit rate as a share of it, and TTFT p50/p90/p99. Each result also carries a digest of the
per-request outcomes (replica, arrival, first token, finish, hits per tier, failure), so two commits
can be checked for identical results.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import multiprocessing as mp
import queue
import resource
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

DEFAULT_TRACE = Path(__file__).parent / "traces" / "mooncake_conversation_trace.jsonl.gz"


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run_policy(opts: dict[str, Any], policy: str, out: Any) -> None:
    """One policy, in its own process: progress messages, then ``("result", dict)``."""
    from kvmesh.sim.fleet import FleetConfig, FleetSimulation
    from kvmesh.sim.report import build_report
    from kvmesh.workload import MooncakeTraceWorkload, Workload, load_workload

    rss_start = _peak_rss_mb()
    workload: Workload
    if opts["workload"] is not None:
        workload = load_workload(opts["workload"])
    else:
        workload = MooncakeTraceWorkload(
            opts["trace"], speedup=opts["speedup"], max_requests=opts["max_requests"]
        )
    config = FleetConfig(
        num_replicas=opts["replicas"],
        model_preset=opts["model_preset"],
        policy=policy,
        block_size=opts["block_size"],
        kv_capacity_tokens=opts["kv_capacity_tokens"],
        cpu_tier_tokens=opts["cpu_tier_tokens"],
        shared_tier=opts["shared_tier"],
        shared_capacity_tokens=opts["shared_capacity_tokens"],
    )
    wall, cpu = time.perf_counter(), time.process_time()
    sim = FleetSimulation(config)

    def progress(done: int) -> None:
        if done % 200 == 0:
            out.put(("progress", done))

    sim.on_progress = progress
    run = sim.run(workload)
    rep = build_report(run, policy)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    s = rep.summary
    out.put(
        (
            "result",
            {
                "policy": policy,
                "requests": s.num_requests,
                "ok": s.num_ok,
                "peak_rss_mb": _peak_rss_mb(),
                "rss_after_imports_mb": rss_start,
                "wall_s": wall,
                "cpu_s": cpu,
                "sim_wall_s": run.wall_s,
                "events": run.num_events,
                "simulated_s": run.duration_s,
                "prompt_tokens": rep.tiers.prompt_tokens,
                "hit_rate": rep.tiers.rates()["total"],
                "ideal_hit_rate": rep.ideal.hit_rate,
                "ideal_capacity_tokens": rep.ideal.capacity_tokens,
                "hit_rate_vs_ideal": rep.hit_rate_vs_ideal,
                "ttft_p50_s": s.ttft.median,
                "ttft_p90_s": s.ttft.p90,
                "ttft_p99_s": s.ttft.p99,
                "preemptions": rep.num_preemptions,
                "outcome_digest": _outcome_digest(run.requests),
            },
        )
    )


def _outcome_digest(requests: Any) -> str:
    """sha256 over every request's replica, times, hits per tier and failure, in request order."""
    h = hashlib.sha256()
    for r in requests:
        row = (r.replica, r.arrival, r.first_token, r.finish, r.hit_gpu, r.hit_cpu, r.hit_shared, r.failed)
        h.update(repr(row).encode())
    return h.hexdigest()[:16]


def _count_requests(trace: Path, max_requests: int | None) -> int:
    if trace.suffix in (".yaml", ".yml"):
        from kvmesh.workload import BlockWorkload, load_workload

        workload = load_workload(trace)
        stream = workload.block_requests() if isinstance(workload, BlockWorkload) else workload.requests()
        return sum(1 for _ in stream)
    with gzip.open(trace, "rt") if trace.suffix == ".gz" else trace.open() as handle:
        n = sum(1 for line in handle if line.strip())
    return n if max_requests is None else min(n, max_requests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--workload", type=Path, help="a workload YAML instead of a trace (e.g. agentic)")
    ap.add_argument("--policies", default="precise,load,random,approximate")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--model-preset", default="qwen3-32b-h100-tp2")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--kv-capacity-tokens", type=int, default=None, help="per replica (default: preset)")
    ap.add_argument("--cpu-tier-tokens", type=int, default=0, help="per replica CPU tier (default: none)")
    ap.add_argument("--shared-tier", choices=("redis", "valkey", "fs"), default=None)
    ap.add_argument("--shared-capacity-tokens", type=int, default=None, help="default: unbounded")
    ap.add_argument("--speedup", type=float, default=1.0)
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    opts = {
        "trace": str(args.trace),
        "workload": None if args.workload is None else str(args.workload),
        "replicas": args.replicas,
        "model_preset": args.model_preset,
        "block_size": args.block_size,
        "kv_capacity_tokens": args.kv_capacity_tokens,
        "cpu_tier_tokens": args.cpu_tier_tokens,
        "shared_tier": args.shared_tier,
        "shared_capacity_tokens": args.shared_capacity_tokens,
        "speedup": args.speedup,
        "max_requests": args.max_requests,
    }
    console = Console(stderr=True)
    source = args.trace if args.workload is None else args.workload
    total = _count_requests(source, args.max_requests)
    ctx = mp.get_context("spawn")
    results: list[dict[str, Any]] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        for policy in [p for p in args.policies.split(",") if p]:
            task = bar.add_task(policy, total=total)
            out = ctx.Queue()
            proc = ctx.Process(target=_run_policy, args=(opts, policy, out))
            proc.start()
            result: dict[str, Any] | None = None
            while result is None:
                try:
                    kind, value = out.get(timeout=1.0)
                except queue.Empty:
                    if not proc.is_alive():
                        raise SystemExit(
                            f"{policy}: the simulation process died (exit {proc.exitcode})"
                        ) from None
                    continue
                if kind == "progress":
                    bar.update(task, completed=value)
                else:
                    result = value
            proc.join()
            bar.update(task, completed=total)
            results.append(result)
    tiers = "".join(
        (
            f", CPU tier {args.cpu_tier_tokens:,}" if args.cpu_tier_tokens else "",
            f", shared tier {args.shared_capacity_tokens or 'unbounded'}" if args.shared_tier else "",
        )
    )
    table = Table(title=f"{source.name}: {total} requests, {args.replicas} × {args.model_preset}, "
                  f"{args.block_size}-token blocks{tiers}")  # fmt: skip
    for col in (
        "policy", "peak RSS MB", "wall s", "CPU s", "hit rate", "ideal shared cache", "hit / ideal",
        "TTFT p50 s", "p90 s", "p99 s", "outcomes",
    ):  # fmt: skip
        table.add_column(col, justify="right")
    for r in results:
        share = r["hit_rate_vs_ideal"]
        table.add_row(
            r["policy"],
            f"{r['peak_rss_mb']:.0f}",
            f"{r['wall_s']:.1f}",
            f"{r['cpu_s']:.1f}",
            f"{r['hit_rate']:.3f}",
            f"{r['ideal_hit_rate']:.3f}",
            "-" if share is None else f"{share:.2f}",
            f"{r['ttft_p50_s']:.3f}",
            f"{r['ttft_p90_s']:.3f}",
            f"{r['ttft_p99_s']:.3f}",
            r["outcome_digest"],
        )
    Console(width=160).print(table)
    if args.json:
        args.json.write_text(json.dumps({"options": opts, "results": results}, indent=2))


if __name__ == "__main__":
    main()
