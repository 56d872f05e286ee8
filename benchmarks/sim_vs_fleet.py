"""The simulator next to a real emulated fleet (engines + router as processes) on one workload.

    .venv/bin/python benchmarks/sim_vs_fleet.py [--engines 3] [--policies precise,round-robin]

Same cost-model preset, block size, KV capacity and router policies on both sides; prints hit rate
and TTFT mean/p90 per policy (real | simulated). tests/sim/test_sim_vs_fleet.py asserts the same
comparison on this workload.
"""

from __future__ import annotations

import argparse
import asyncio

from kvmesh.bench.compare import compare_policies
from kvmesh.bench.runner import RunOptions
from kvmesh.fleet import Fleet
from kvmesh.fleet import FleetConfig as LaunchConfig
from kvmesh.sim.fleet import FleetConfig, simulate
from kvmesh.sim.report import build_report
from kvmesh.workload import SharedPrefixWorkload, Stage

PRESET = "qwen3-32b-h100-tp2"


def workload() -> SharedPrefixWorkload:
    return SharedPrefixWorkload(
        num_groups=6, num_prompts_per_group=4, system_prompt_len=1536, question_len=128, output_len=4,
        stages=[Stage(3.0, 16.0)], seed=11, vocab_size=259,
    )  # fmt: skip


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--policies", default="precise,round-robin")
    args = ap.parse_args()
    policies = args.policies.split(",")
    launch = LaunchConfig(
        num_engines=args.engines, model="tiny-random-llama", emulate=PRESET, shared="none", policy=policies[0]
    )
    async with Fleet(launch) as fleet:
        real = await compare_policies(
            fleet, workload(), policies, RunOptions(base_url="", model="", progress=False)
        )
    print("| policy | hit rate real | sim | TTFT mean s real | sim | TTFT p90 s real | sim |")
    print("|---|---|---|---|---|---|---|")
    for p in policies:
        s = build_report(
            simulate(FleetConfig(num_replicas=args.engines, model_preset=PRESET, policy=p), workload())
        )
        r, q = real[p].summary, s.summary
        print(
            f"| {p} | {r.hit_rate:.3f} | {q.hit_rate:.3f} | {r.ttft.mean:.3f} | {q.ttft.mean:.3f} | "
            f"{r.ttft.p90:.3f} | {q.ttft.p90:.3f} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
