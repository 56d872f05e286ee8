"""What a dead or black-holed Redis costs the caller, per operation, against the configured timeout.

Starts its own redis-server, stores prompts, then (1) pauses it with SIGSTOP and (2) kills it, and
times each ``lookup`` / ``retrieve`` / ``store`` made meanwhile. Expected: calls that reach the tier
cost about one timeout until the breaker opens, then next to nothing; nothing raises.

    python -m benchmarks.store_faults [--json] [--timeout 0.2] [--ops 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np

from kvmesh.core.hashing import Namespace
from kvmesh.store.cache_engine import KVCacheEngine
from kvmesh.store.config import StoreConfig
from kvmesh.store.local_server import LocalServer

NS = Namespace("bench-faults")


async def _phase(engine: KVCacheEngine, tokens: list[int], kv: np.ndarray, ops: int) -> dict[str, float]:
    costs: list[float] = []
    for i in range(ops):
        start = time.perf_counter()
        if i % 3 == 0:
            await engine.lookup(tokens, NS)
        elif i % 3 == 1:
            await engine.retrieve(tokens, NS)
        else:
            await engine.store([t + i for t in tokens], NS, kv)
        costs.append(time.perf_counter() - start)
    return {
        "ops": ops,
        "max_s": max(costs),
        "median_s": statistics.median(costs),
        "first3_s": sum(costs[:3]),
        "rest_mean_s": statistics.mean(costs[3:]) if len(costs) > 3 else 0.0,
    }


async def run(timeout_s: float, ops: int) -> dict[str, object]:
    server = LocalServer("redis").start()
    try:
        config = StoreConfig(
            chunk_size=64,
            local_cpu=False,
            remote_url=server.url,
            remote_timeout_s=timeout_s,
            breaker_failures=3,
            breaker_backoff_s=60.0,
            breaker_max_backoff_s=60.0,
        )
        tokens = list(range(256))
        kv = np.zeros((4, 2, 4, 256, 64), np.float32)
        results: dict[str, object] = {"timeout_s": timeout_s}
        for phase in ("paused", "killed"):
            engine = KVCacheEngine.from_config(config)
            await engine.store(tokens, NS, kv)
            await engine.drain()
            if phase == "paused":
                server.pause()
            else:
                server.resume()
                server.kill()
            results[phase] = await _phase(engine, tokens, kv, ops)
            results[f"{phase}_counters"] = engine.stats()["tiers"]["redis"]  # type: ignore[index]
            await engine.aclose()
        return results
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--timeout", type=float, default=0.2)
    parser.add_argument("--ops", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = asyncio.run(run(args.timeout, args.ops))
    if args.json:
        print(json.dumps(report, default=str))
        return
    print(f"configured timeout {args.timeout:.3f} s, breaker opens after 3 failures")
    for phase in ("paused", "killed"):
        r = report[phase]
        assert isinstance(r, dict)
        print(
            f"{phase:7}: max {r['max_s']:.3f} s/op, first 3 ops {r['first3_s']:.3f} s in total, "
            f"then {r['rest_mean_s'] * 1e6:.0f} µs/op (breaker open), median {r['median_s'] * 1e6:.0f} µs"
        )


if __name__ == "__main__":
    main()
