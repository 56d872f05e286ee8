"""Real model (SmolLM2 by default): TTFT of a shared prefix served cold, from the local cache, and from the store.

    .venv/bin/python benchmarks/engine_store_ttft.py [--prefix-len 2048[,8192...]] [--question-len 64] [--trials 5]
        [--model smollm2|DIR] [--device cuda] [--dtype bfloat16] [--shared-dir /dev/shm]

Two engine processes share a directory store. For each trial a fresh prefix of ``--prefix-len``
tokens (real text) is used:

    cold   reader serves prefix + question A        nothing cached anywhere
    store  writer serves prefix' + question B; once its chunks are in the shared directory,
           the reader serves prefix' + question C  reader's device tier misses, the store hits
    local  reader serves prefix' + question D       reader's device tier hits

TTFT is measured by a streaming client (first SSE chunk). The reader's own account of each store load
comes from its ``/metrics`` around the store request: ``store_fetch_s`` (lookup, tier reads, checksums)
and ``store_to_device_s`` (the copy into the runner's memory at admission). Goals: store ≤ 1.3 × local, cold ≥ 4 × store.
Ratios are reported both ways: from the medians of each column, and as the median of per-trial
ratios (each trial's store and local requests run back to back on the same prefix, so slow drifts
in machine load cancel out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))

from engine_common import EngineProcess, start_engine, timed_completion

from kvmesh.store.backends.files import SUFFIX

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "river",
    "mountain",
    "valley",
    "ocean",
    "forest",
    "desert",
    "city",
    "harbor",
    "bridge",
    "tower",
    "market",
    "garden",
    "library",
    "museum",
    "station",
    "airport",
    "castle",
    "village",
    "island",
]


def text_tokens(http_tokens: list[int], n: int) -> list[int]:
    assert len(http_tokens) >= n, f"need {n} tokens, have {len(http_tokens)}"
    return http_tokens[:n]


async def tokenize(http: aiohttp.ClientSession, url: str, text: str) -> list[int]:
    async with http.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}) as r:
        return list((await r.json())["tokens"])


def passage(seed: int, words: int) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def store_load_seconds(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """The engine's running totals of store fetch and to-device seconds (``kvmesh:store_*_seconds``)."""
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    totals = {"kvmesh:store_fetch_seconds": 0.0, "kvmesh:store_to_device_seconds": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals["kvmesh:store_fetch_seconds"], totals["kvmesh:store_to_device_seconds"]


def count_chunks(root: Path) -> int:
    return sum(1 for p in root.rglob(f"*{SUFFIX}") if p.is_file()) if root.exists() else 0


async def wait_chunks(root: Path, at_least: int) -> None:
    """Wait until the shared directory holds ``at_least`` chunk files (background writes land)."""
    for _ in range(1200):
        if count_chunks(root) >= at_least:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"the shared directory never reached {at_least} chunks")


async def measure(
    http: aiohttp.ClientSession,
    writer: EngineProcess,
    reader: EngineProcess,
    shared_dir: Path,
    prefix_len: int,
    args: argparse.Namespace,
    question: Callable[[int], list[int]],
) -> list[dict[str, float]]:
    """``args.trials`` trials of cold / store / local TTFT at one prefix length."""
    rows = []
    for trial in range(args.trials):
        seed = 1_000 * prefix_len + 2 * trial
        cold_prefix = text_tokens(await tokenize(http, reader.url, passage(seed, prefix_len)), prefix_len)
        shared_prefix = text_tokens(
            await tokenize(http, reader.url, passage(seed + 1, prefix_len)), prefix_len
        )
        q = 4 * trial
        chunks = prefix_len // 256
        before = count_chunks(shared_dir)
        cold = await timed_completion(http, reader.url, cold_prefix + question(q), 1)
        await wait_chunks(shared_dir, before + chunks)  # the reader's own write-back
        await timed_completion(http, writer.url, shared_prefix + question(q + 1), 1)
        await wait_chunks(shared_dir, before + 2 * chunks)
        fetch_before, copy_before = await store_load_seconds(http, reader.url)
        from_store = await timed_completion(http, reader.url, shared_prefix + question(q + 2), 1)
        fetch_after, copy_after = await store_load_seconds(http, reader.url)
        local = await timed_completion(http, reader.url, shared_prefix + question(q + 3), 1)
        rows.append(
            {
                "cold_s": cold.ttft,
                "store_s": from_store.ttft,
                "local_s": local.ttft,
                "store_fetch_s": fetch_after - fetch_before,
                "store_to_device_s": copy_after - copy_before,
                "store_cached_tokens": from_store.cached_tokens,
                "local_cached_tokens": local.cached_tokens,
            }
        )
        if not args.json:
            print(json.dumps({"prefix_len": prefix_len, **rows[-1]}), file=sys.stderr)
    return rows


def summarize(prefix_len: int, rows: list[dict[str, float]]) -> dict[str, Any]:
    columns = ("cold_s", "store_s", "local_s", "store_fetch_s", "store_to_device_s")
    med = {k: statistics.median(r[k] for r in rows) for k in columns}
    return {
        "prefix_len": prefix_len,
        "median_ttft_s": med,
        "store_over_local": med["store_s"] / med["local_s"],
        "cold_over_store": med["cold_s"] / med["store_s"],
        "store_over_local_paired_median": statistics.median(r["store_s"] / r["local_s"] for r in rows),
        "cold_over_store_paired_median": statistics.median(r["cold_s"] / r["store_s"] for r in rows),
        "rows": rows,
    }


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix-len", default="2048", help="tokens; a comma list runs each on the same engines")
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine process (CPU)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (both engines)")
    ap.add_argument("--dtype", help="model dtype (engine default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--shared-dir", type=Path, help="parent of the shared store directory (default: temp)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lengths = [int(x) for x in args.prefix_len.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-store-", dir=args.shared_dir) as tmp:
        shared_dir = Path(tmp) / "shared"
        common = ["--model", args.model, "--store", f"file://{shared_dir}", "--device", args.device]
        common += ["--max-model-len", str(max(lengths) + 8 * args.question_len)]
        if args.dtype:
            common += ["--dtype", args.dtype]
        if args.device == "cpu":
            common += ["--num-threads", str(args.threads)]
        writer = await start_engine(*common)
        reader = await start_engine(*common)
        results = []
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
                pool = await tokenize(http, reader.url, passage(10_000, args.question_len * 40))

                def question(i: int) -> list[int]:
                    return pool[i * args.question_len : (i + 1) * args.question_len]

                # Warm both processes (first-call allocations, kernels) with an unrelated prompt.
                for eng in (writer, reader):
                    await timed_completion(http, eng.url, question(30) * 4, 2)
                for n in lengths:
                    rows = await measure(http, writer, reader, shared_dir, n, args, question)
                    results.append(summarize(n, rows))
        finally:
            await asyncio.gather(writer.stop(), reader.stop())
    report = {
        "model": reader.info.get("model", args.model),
        "device": args.device,
        "kv_bytes_per_token": reader.info.get("kv_bytes_per_token"),
        "question_len": args.question_len,
        "trials": args.trials,
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    for res in results:
        med = res["median_ttft_s"]
        rows = res["rows"]
        table = Table(
            title=f"{report['model']} on {args.device}: TTFT, {res['prefix_len']}-token shared prefix "
            f"+ {args.question_len}-token question"
        )
        for col in ("path", "median TTFT s", "cached tokens"):
            table.add_column(col, justify="right")
        table.add_row("cold", f"{med['cold_s']:.3f}", "0")
        table.add_row(
            "store (other engine wrote it)", f"{med['store_s']:.3f}", str(rows[-1]["store_cached_tokens"])
        )
        table.add_row("local device tier", f"{med['local_s']:.3f}", str(rows[-1]["local_cached_tokens"]))
        con.print(table)
        con.print(
            f"store / local = {res['store_over_local']:.2f} from medians, "
            f"{res['store_over_local_paired_median']:.2f} paired (goal ≤ 1.3); "
            f"cold / store = {res['cold_over_store']:.1f}× from medians, "
            f"{res['cold_over_store_paired_median']:.1f}× paired (goal ≥ 4)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
