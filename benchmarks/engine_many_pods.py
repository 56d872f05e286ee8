"""How many emulated engines one small machine hosts: N ``kvmesh engine --emulate`` processes under load.

    .venv/bin/python benchmarks/engine_many_pods.py [--pods 8] [--concurrency 16] [--seconds 30]

Each pod gets a closed loop of ``--concurrency`` streaming requests (unique prompts, fixed output
length). The emulation keeps up when every pod's measured end-to-end latency stays close to what
the cost model alone predicts for the same batch; the report gives measured / modelled E2E, output
tokens per second, and the CPU each engine process used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))

from engine_common import start_engine, timed_completion

from kvmesh.engine.cost_model import CostModel, get_preset


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def closed_loop(url: str, concurrency: int, seconds: float, prompt_len: int, out_len: int, seed: int) -> list:
    rng = random.Random(seed)
    results = []
    deadline = time.perf_counter() + seconds

    async def worker(http: aiohttp.ClientSession) -> None:
        while time.perf_counter() < deadline:
            prompt = [rng.randrange(3, 250) for _ in range(prompt_len)]
            results.append(await timed_completion(http, url, prompt, out_len, ignore_eos=True))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return results


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--preset", default="qwen3-32b-h100-tp2")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    engines = []
    for _ in range(args.pods):
        engines.append(await start_engine("--model", "tiny-random-llama", "--emulate", args.preset))
    try:
        cpu0 = [cpu_seconds(e.proc.pid) for e in engines]
        t0 = time.perf_counter()
        per_pod = await asyncio.gather(
            *(
                closed_loop(e.url, args.concurrency, args.seconds, args.prompt_len, args.output_len, i)
                for i, e in enumerate(engines)
            )
        )
        wall = time.perf_counter() - t0
        cpu = [cpu_seconds(e.proc.pid) - c for e, c in zip(engines, cpu0, strict=True)]
    finally:
        await asyncio.gather(*(e.stop() for e in engines))
    cost = CostModel(get_preset(args.preset))
    c, n, o = args.concurrency, args.prompt_len, args.output_len
    # Steady state of a closed loop: c requests decode together; each also pays its own prefill and
    # shares steps with the other requests' prefills (c prefills of n tokens per round).
    decode_step = cost.decode_step_time([n + o // 2] * c)
    modelled_e2e = o * decode_step + c * (cost.prefill_time(0, n) - cost.preset.step_overhead)
    e2es = [r.e2e for rs in per_pod for r in rs]
    tokens = sum(r.num_tokens for rs in per_pod for r in rs)
    report = {
        "pods": args.pods,
        "preset": args.preset,
        "concurrency_per_pod": c,
        "requests": len(e2es),
        "output_tok_per_s_total": tokens / wall,
        "e2e_median_s": statistics.median(e2es),
        "e2e_modelled_s": modelled_e2e,
        "e2e_ratio": statistics.median(e2es) / modelled_e2e,
        "engine_cpu_fraction_mean": statistics.fmean(cpu) / wall,
        "engine_cpu_fraction_total": sum(cpu) / wall,
        "cores": os.cpu_count(),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
