"""How fast the simulator runs: simulated requests per second of wall time.

    .venv/bin/python benchmarks/sim_scale.py --requests 1000000 [--replicas 16] [--policy precise]

Workload: shared_prefix, 64 groups × 32 prompts, 96-token system prompts + 32-token questions,
16 output tokens, Poisson at ``--rate`` req/s. Every request still goes through the router's real
scheduler and index, the engine's real prefix cache (allocate, cache, free, KV events) and its cost
model; only the prompts are short. Prints wall time, µs per request and events per second.
"""

from __future__ import annotations

import argparse
import json
import time

from kvmesh.sim.fleet import FleetConfig, FleetSimulation
from kvmesh.workload import SharedPrefixWorkload, Stage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--rate", type=float, default=4000.0)
    ap.add_argument("--policy", default="precise")
    ap.add_argument("--model-preset", default="llama-3.1-8b-h100")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    wl = SharedPrefixWorkload(
        num_groups=64, num_prompts_per_group=32, system_prompt_len=96, question_len=32, output_len=16,
        stages=[Stage(args.rate, args.requests / args.rate)], seed=0, name="scale",
    )  # fmt: skip
    t0 = time.perf_counter()
    n = sum(1 for _ in wl.requests())
    gen_s = time.perf_counter() - t0
    cfg = FleetConfig(num_replicas=args.replicas, model_preset=args.model_preset, policy=args.policy)
    sim = FleetSimulation(cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    run = sim.run(wl)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    ok = sum(1 for r in run.requests if r.failed is None)
    out = {
        "requests": len(run.requests),
        "ok": ok,
        "replicas": args.replicas,
        "policy": args.policy,
        "wall_s": wall,
        "cpu_s": cpu,
        "workload_generation_s": gen_s,
        "us_per_request": wall / max(len(run.requests), 1) * 1e6,
        "events": run.num_events,
        "events_per_s": run.num_events / wall,
        "simulated_s": run.duration_s,
        "hit_rate": sum(r.cached_tokens for r in run.requests)
        / max(sum(r.prompt_len for r in run.requests), 1),
    }
    assert n == len(run.requests)
    print(
        json.dumps(out, indent=2)
        if args.json
        else " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items())
    )


if __name__ == "__main__":
    main()
