"""Emulated engine: cold TTFT against the cost-model formula, and the throughput saturation point.

    .venv/bin/python benchmarks/engine_emulated.py [--preset qwen3-32b-h100-tp2] [--json]

1. TTFT: cold prompts of ``--prompt-len`` tokens sent one at a time (low load); the measured streamed
   TTFT is compared with ``CostModel.cold_prefill_time``.
2. Saturation: Poisson arrivals of cold (unique) prompts at increasing rates; each stage reports
   completed req/s, output tok/s and TTFT p50/p90. The saturation point is the highest offered rate
   whose TTFT p50 stays under ``--slo`` × the cold formula (beyond it the queue grows without bound);
   the formula's own bound is 1 / prefill time, which decode steps lower further.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))

from engine_common import percentile, start_engine, timed_completion

from kvmesh.engine.cost_model import CostModel, get_preset


def cold_prompt(rng: random.Random, n: int) -> list[int]:
    # Token ids of the byte-level tokenizer the emulated engine serves with; unique per request.
    return [rng.randrange(3, 250) for _ in range(n)]


async def ttft_check(url: str, n: int, trials: int, rng: random.Random) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as http:
        await timed_completion(http, url, cold_prompt(rng, 64), 1)  # warm the connection
        for _ in range(trials):
            t = await timed_completion(http, url, cold_prompt(rng, n), 4, ignore_eos=True)
            assert t.cached_tokens == 0
            out.append(t.ttft)
    return out


async def stage(url: str, rate: float, duration: float, n: int, out_len: int, rng: random.Random) -> dict:
    results = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        tasks = []
        start = time.perf_counter()
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t > duration:
                break
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(
                    timed_completion(http, url, cold_prompt(rng, n), out_len, ignore_eos=True)
                )
            )
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    ttfts = [r.ttft for r in results]
    return {
        "rate": rate,
        "requests": len(results),
        "req_per_s": len(results) / elapsed,
        "output_tok_per_s": sum(r.num_tokens for r in results) / elapsed,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p90": percentile(ttfts, 0.9),
        "e2e_mean": statistics.fmean(r.e2e for r in results),
    }


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-32b-h100-tp2")
    ap.add_argument("--prompt-len", type=int, default=7200)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--rates", default="0.5,1.0,1.25,1.5,1.75,2.0,2.5")
    ap.add_argument("--stage-seconds", type=float, default=30.0)
    ap.add_argument("--slo", type=float, default=5.0, help="TTFT p50 bound as a multiple of the cold formula")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(0)
    cost = CostModel(get_preset(args.preset))
    formula = cost.cold_prefill_time(args.prompt_len)
    engine = await start_engine("--model", "tiny-random-llama", "--emulate", args.preset)
    try:
        ttfts = await ttft_check(engine.url, args.prompt_len, args.trials, rng)
        stages = []
        for rate in (float(r) for r in args.rates.split(",")):
            stages.append(
                await stage(engine.url, rate, args.stage_seconds, args.prompt_len, args.output_len, rng)
            )
            if not args.json:
                print(json.dumps(stages[-1]), file=sys.stderr)
    finally:
        await engine.stop()
    median = statistics.median(ttfts)
    ok = [s for s in stages if s["ttft_p50"] <= args.slo * formula]
    report = {
        "preset": args.preset,
        "prompt_len": args.prompt_len,
        "ttft_formula_s": formula,
        "ttft_measured_median_s": median,
        "ttft_measured_min_s": min(ttfts),
        "ttft_measured_max_s": max(ttfts),
        "ttft_ratio": median / formula,
        "formula_max_rate": 1.0 / formula,
        "saturation_rate": max((s["rate"] for s in ok), default=None),
        "max_completed_req_per_s": max(s["req_per_s"] for s in stages),
        "stages": stages,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        con = Console()
        con.print(
            f"[bold]{args.preset}[/] cold {args.prompt_len}-token TTFT: formula {formula:.3f} s, measured median "
            f"{median:.3f} s (min {min(ttfts):.3f}, max {max(ttfts):.3f}) → ratio {median / formula:.3f}"
        )
        table = Table(
            title=f"saturation ({args.prompt_len} cold prompt tokens, {args.output_len} output tokens)"
        )
        for col in ("offered req/s", "done req/s", "output tok/s", "TTFT p50 s", "TTFT p90 s"):
            table.add_column(col, justify="right")
        for s in stages:
            table.add_row(
                f"{s['rate']:.2f}",
                f"{s['req_per_s']:.2f}",
                f"{s['output_tok_per_s']:.0f}",
                f"{s['ttft_p50']:.3f}",
                f"{s['ttft_p90']:.3f}",
            )
        con.print(table)
        con.print(
            f"formula bound 1/prefill = {1 / formula:.2f} req/s; saturation (TTFT p50 ≤ {args.slo}× formula): "
            f"{report['saturation_rate']} req/s; most completed: {report['max_completed_req_per_s']:.2f} req/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
