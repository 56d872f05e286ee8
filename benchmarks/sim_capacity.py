"""Worked capacity answers, computed by the fleet simulator (docs/sim.md quotes this script's output).

Every fleet uses 64-token blocks (llm-d's setting; 4× fewer keys to hash and index than vLLM's default 16).

    .venv/bin/python benchmarks/sim_capacity.py [--only q1|q2|q3] [--json out.json]

q1  3 replicas at 5 req/s: is cross-replica sharing worth it?
q2  20 replicas at 1000 req/s, prompts 80% shared prefix: the hit-rate gain of cache-aware routing
    and of a shared tier over per-replica caches.
q3  10 replicas at 50 req/s each, 30% of requests missing locally but held by the shared tier,
    200 MB of KV per prefix: the network bandwidth it takes, and what a thinner network does.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from kvmesh.sim.fleet import FleetConfig, simulate
from kvmesh.sim.report import SimReport, build_report
from kvmesh.workload import MooncakeTraceWorkload, SharedPrefixWorkload, Stage, Workload

MODEL = "llama-3.1-8b-h100"


def run(label: str, cfg: FleetConfig, workload: Workload) -> SimReport:
    rep = build_report(simulate(cfg, workload), label)
    s = rep.summary
    print(
        f"| {label} | {s.ttft.mean:.3f} | {s.ttft.p90:.3f} | {rep.tiers.rates()['gpu']:.3f} | "
        f"{rep.tiers.rates()['shared']:.3f} | {s.hit_rate:.3f} | {rep.network.read_gbps_mean:.1f} | "
        f"{s.num_failed} | {rep.wall_s:.0f} s |",
        flush=True,
    )
    return rep


def with_and_without_shared_tier(
    policies: tuple[str, ...], num_replicas: int, workload: Workload
) -> dict[str, SimReport]:
    """Each policy on a fleet of 64-token blocks, alone and over a 100 Gb/s shared tier, as table rows."""
    out: dict[str, SimReport] = {}
    for policy in policies:
        for shared in (None, "redis"):
            cfg = FleetConfig(
                num_replicas=num_replicas, model_preset=MODEL, block_size=64, policy=policy,
                shared_tier=shared, net_gbps=100.0,
            )  # fmt: skip
            label = f"{policy}{' + shared tier' if shared else ''}"
            out[label] = run(label, cfg, workload)
    return out


HEADER = (
    "| fleet | TTFT mean s | TTFT p90 s | GPU hit | shared hit | total hit | shared read Gb/s | failed | sim wall |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def q1() -> dict[str, Any]:
    """3 × Llama-3.1-8B on H100 at 5 req/s; 6000-token system prompts, few or many."""
    out: dict[str, Any] = {}
    for groups in (20, 150):
        wl = SharedPrefixWorkload(
            num_groups=groups, num_prompts_per_group=10, system_prompt_len=6000, question_len=400,
            output_len=200, stages=[Stage(5.0, 600.0)], seed=1, name=f"q1-{groups}groups",
        )  # fmt: skip
        print(
            f"\n### {groups} system prompts × 6000 tokens ({groups * 6000 / 1e6:.2f} M tokens of prefixes)\n"
        )
        print(HEADER)
        for label, rep in with_and_without_shared_tier(("round-robin", "precise"), 3, wl).items():
            out[f"{groups}/{label}"] = rep.to_dict()
    return out


def q2() -> dict[str, Any]:
    """20 × Llama-3.1-8B at 1000 req/s; 800 of each prompt's 1000 tokens are one of 800 shared prefixes."""
    wl = SharedPrefixWorkload(
        num_groups=800, num_prompts_per_group=25, system_prompt_len=800, question_len=200, output_len=64,
        stages=[Stage(1000.0, 20.0)], seed=2, name="q2",
    )  # fmt: skip
    print("\n### 20 replicas, 1000 req/s, 80% shared prefix (800 prefixes of 800 tokens)\n")
    print(HEADER)
    reports = with_and_without_shared_tier(("random", "precise"), 20, wl)
    return {label: rep.to_dict() for label, rep in reports.items()}


def mooncake_trace(path: Path, *, rate: float, duration: float, groups: int, seed: int = 3) -> Path:
    """A Mooncake-format trace: 3 × 512-token prefix blocks drawn uniformly from ``groups`` + 1 unique block."""
    rng = random.Random(seed)
    t = 0.0
    next_id = groups * 3
    with path.open("w") as fh:
        while t < duration:
            t += rng.expovariate(rate)
            g = rng.randrange(groups)
            ids = [3 * g, 3 * g + 1, 3 * g + 2, next_id]
            next_id += 1
            rec = {
                "timestamp": int(t * 1000),
                "input_length": 1536 + 64,
                "output_length": 32,
                "hash_ids": ids,
            }
            fh.write(json.dumps(rec) + "\n")
    return path


def q3() -> dict[str, Any]:
    """10 × Llama-3.1-8B at 50 req/s each; 1536-token prefixes = 201 MB of KV each (128 KiB/token)."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trace = mooncake_trace(Path(tmp) / "q3.jsonl", rate=500.0, duration=30.0, groups=300)
        wl = MooncakeTraceWorkload(trace, name="q3")
        print("\n### 10 replicas × 50 req/s, 201 MB prefixes, random routing + shared tier\n")
        print(HEADER)
        for gbps in (100.0, 25.0, 10.0):
            cfg = FleetConfig(
                num_replicas=10,
                model_preset=MODEL,
                block_size=64,
                policy="random",
                shared_tier="redis",
                net_gbps=gbps,
            )
            rep = run(f"NIC {gbps:g} Gb/s", cfg, wl)
            d = rep.to_dict()
            n = rep.summary.num_requests
            remote = sum(1 for r in rep.run.results if r.ok) and rep.tiers.shared_hit_tokens / (1536 * n)
            d["remote_miss_fraction"] = remote
            d["formula_gbps"] = 10 * 50 * remote * 1536 * 131072 * 8 / 1e9
            out[f"{gbps:g}"] = d
            print(
                f"\nremote-miss fraction {remote:.3f}; formula 10 × 50 × {remote:.3f} × 201.3 MB = "
                f"{d['formula_gbps']:.0f} Gb/s; simulated mean {rep.network.read_gbps_mean:.0f} Gb/s "
                f"(busiest replica NIC {rep.network.read_gbps_peak_replica:.1f} Gb/s)\n"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("q1", "q2", "q3"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results: dict[str, Any] = {}
    for name, fn in (("q1", q1), ("q2", q2), ("q3", q3)):
        if args.only in (None, name):
            print(f"\n## {name}")
            results[name] = fn()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
