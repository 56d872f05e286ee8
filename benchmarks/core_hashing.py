"""Block-key throughput: tokens/s for sha256 and xxh3 chains, and the time to key a 128k-token prompt.

python -m benchmarks.core_hashing [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace
from kvmesh.core.vllm_hashing import vllm_block_hashes


def best_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, args.tokens).tolist()
    results = {}
    for algo in (HashAlgo.SHA256, HashAlgo.XXH3):
        hasher = BlockHasher(Namespace("bench-model"), 16, algo)
        t = best_of(lambda h=hasher: h.hash_blocks(tokens))
        results[f"kvmesh-{algo.value}"] = {"seconds": t, "tokens_per_s": args.tokens / t}
    small = tokens[:16384]
    t = best_of(lambda: vllm_block_hashes(small, 16, seed="0"), 3)
    results["vllm-sha256-cbor"] = {"seconds": t * args.tokens / len(small), "tokens_per_s": len(small) / t}
    if args.json:
        print(json.dumps({"prompt_tokens": args.tokens, "results": results}, indent=2))
        return
    print(f"keying a {args.tokens}-token prompt (block 16, list[int] input, best of 5)")
    for name, r in results.items():
        print(f"  {name:18s} {r['seconds'] * 1e3:8.2f} ms   {r['tokens_per_s'] / 1e6:6.2f} M tokens/s")


if __name__ == "__main__":
    main()
