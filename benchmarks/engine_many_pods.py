"""How many emulated engines one small machine hosts: N ``kvmesh engine --emulate`` processes under load.

    .venv/bin/python benchmarks/engine_many_pods.py [--pods 8] [--concurrency 16] [--seconds 30]

Each pod gets a closed loop of ``--concurrency`` streaming requests (unique prompts, fixed output
length). Side by side in the same run, one engine core drives the same closed loop in-process (no
HTTP, no other pods): that is what the cost model alone yields. The emulation keeps up when the
pods' latencies match the reference; the report gives both, their ratio, output tokens per second,
and the CPU each engine process used.
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

from kvmesh.engine.core import EngineCore, EngineRequest, SchedulerConfig
from kvmesh.engine.emulated_runner import EmulatedRunner
from kvmesh.engine.prefix_cache import PrefixCache
from kvmesh.engine.runner import SamplingParams


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def closed_loop(
    url: str, concurrency: int, seconds: float, prompt_len: int, out_len: int, seed: int
) -> list:
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


async def reference(preset: str, concurrency: int, seconds: float, prompt_len: int, out_len: int) -> list:
    """The same closed loop against one in-process engine core: (ttft, e2e) per request."""
    runner = EmulatedRunner(preset, vocab_size=256)
    p = runner.preset
    core = EngineCore(
        runner,
        PrefixCache.create_simulated(runner.cost.kv_capacity_tokens()),
        SchedulerConfig(max_num_seqs=p.max_num_seqs, max_num_batched_tokens=p.max_num_batched_tokens),
    )
    await core.start()
    rng = random.Random(99)
    results = []
    deadline = time.perf_counter() + seconds
    counter = 0

    async def worker() -> None:
        nonlocal counter
        while time.perf_counter() < deadline:
            counter += 1
            prompt = [rng.randrange(3, 250) for _ in range(prompt_len)]
            start = time.perf_counter()
            req = await core.add_request(
                EngineRequest(f"r{counter}", prompt, SamplingParams(max_tokens=out_len, ignore_eos=True))
            )
            ttft = None
            async for out in req:
                if ttft is None and out.new_token_ids:
                    ttft = time.perf_counter() - start
            results.append((ttft, time.perf_counter() - start))

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await core.aclose()
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
    ref = await reference(args.preset, args.concurrency, args.seconds, args.prompt_len, args.output_len)
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
    e2es = [r.e2e for rs in per_pod for r in rs]
    ttfts = [r.ttft for rs in per_pod for r in rs]
    ref_ttft = statistics.median(t for t, _ in ref)
    ref_e2e = statistics.median(e for _, e in ref)
    tokens = sum(r.num_tokens for rs in per_pod for r in rs)
    report = {
        "pods": args.pods,
        "preset": args.preset,
        "concurrency_per_pod": args.concurrency,
        "requests": len(e2es),
        "output_tok_per_s_total": tokens / wall,
        "pods_ttft_median_s": statistics.median(ttfts),
        "reference_ttft_median_s": ref_ttft,
        "pods_e2e_median_s": statistics.median(e2es),
        "reference_e2e_median_s": ref_e2e,
        "e2e_ratio": statistics.median(e2es) / ref_e2e,
        "ttft_ratio": statistics.median(ttfts) / ref_ttft,
        "engine_cpu_fraction_mean": statistics.fmean(cpu) / wall,
        "engine_cpu_fraction_total": sum(cpu) / wall,
        "cores": os.cpu_count(),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
