"""Router index benchmarks: event ingestion rate and per-request scoring cost.

    .venv/bin/python benchmarks/router_index.py [--json] [--algo sha256|xxh3]

* ingest: BlockStored batches (32 blocks of 16 tokens each, as a 512-token prefill publishes),
  chained continuations and BlockRemoved evictions from 8 pods, applied by ``EventApplier`` to an
  ``InMemoryIndex``; reported as block events per second, from pre-decoded batches and from raw
  msgpack payloads (decode included).
* score: one 8k-token prompt through ``Scheduler.pick`` with the ``precise`` preset over 8
  endpoints, hashing included; cold (no pod holds block 0), half cached and fully cached.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from kvmesh.core.events import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace
from kvmesh.core.types import PodId
from kvmesh.router.index import InMemoryIndex
from kvmesh.router.ingest import EventApplier
from kvmesh.router.scheduler import Scheduler, load_scheduler_config
from kvmesh.router.types import EndpointState, RoutingRequest

MODEL = "bench-model"
BLOCK = 16
PODS = [PodId(f"http://10.0.0.{i}:8000") for i in range(8)]


def make_batches(
    n_batches: int, algo: HashAlgo, seed: int = 0
) -> tuple[list[tuple[PodId, KVEventBatch]], int]:
    """A realistic stream: new chains, continued chains, and evictions."""
    rng = random.Random(seed)
    hasher = BlockHasher(Namespace(MODEL), BLOCK, algo)
    out: list[tuple[PodId, KVEventBatch]] = []
    live: dict[PodId, list[int]] = {p: [] for p in PODS}
    next_hash = 1
    n_block_events = 0
    for _ in range(n_batches):
        pod = rng.choice(PODS)
        events: list[Any] = []
        tokens = [rng.randrange(40_000) for _ in range(32 * BLOCK)]
        hashes = list(range(next_hash, next_hash + 32))
        next_hash += 32
        events.append(BlockStored(hashes[:16], None, tokens[: 16 * BLOCK], BLOCK))
        events.append(BlockStored(hashes[16:], hashes[15], tokens[16 * BLOCK :], BLOCK))
        live[pod].extend(hashes)
        n_block_events += 32
        if len(live[pod]) > 4096:
            gone, live[pod] = live[pod][:32], live[pod][32:]
            events.append(BlockRemoved(gone))
            n_block_events += 32
        out.append((pod, KVEventBatch(0.0, events)))
    del hasher
    return out, n_block_events


def bench_ingest(algo: HashAlgo, n_batches: int) -> dict[str, float]:
    batches, n_events = make_batches(n_batches, algo)
    applier = EventApplier(InMemoryIndex(), model=MODEL, algo=algo)
    start = time.perf_counter()
    for pod, batch in batches:
        applier.apply_batch(pod, batch)
    decoded_s = time.perf_counter() - start

    payloads = [(pod, encode_batch(b.events, ts=0.0)) for pod, b in batches]
    applier = EventApplier(InMemoryIndex(), model=MODEL, algo=algo)
    start = time.perf_counter()
    for pod, payload in payloads:
        applier.apply_batch(pod, decode_batch(payload))
    raw_s = time.perf_counter() - start
    return {
        "block_events": n_events,
        "events_per_s_decoded": n_events / decoded_s,
        "events_per_s_from_payload": n_events / raw_s,
    }


def bench_score(algo: HashAlgo, repeats: int) -> dict[str, float]:
    rng = random.Random(1)
    prompt = [rng.randrange(40_000) for _ in range(8192)]
    ns = Namespace(MODEL)
    keys = BlockHasher(ns, BLOCK, algo).hash_blocks(prompt)
    index = InMemoryIndex()
    scheduler = Scheduler.from_config(
        load_scheduler_config("precise"), index=index, hash_algo=algo, rng=random.Random(0)
    )
    endpoints = [EndpointState(p, waiting=i % 3, kv_cache_usage=0.1 * i) for i, p in enumerate(PODS)]
    out: dict[str, float] = {}
    from kvmesh.core.types import Medium
    from kvmesh.router.index import medium_set

    for label, holders in (
        ("cold", {}),
        ("half", {PODS[2]: 256, PODS[5]: 64}),
        ("full", {PODS[3]: 512, PODS[1]: 300}),
    ):
        index = InMemoryIndex()
        for pod, n in holders.items():
            index.add(keys[:n], pod, medium_set(Medium.GPU))
        scheduler.index = index
        samples = []
        for i in range(repeats):
            request = RoutingRequest(f"r{i}", prompt, ns)
            start = time.perf_counter()
            decision = scheduler.pick(request, endpoints)
            samples.append(time.perf_counter() - start)
            assert decision is not None
        samples.sort()
        out[f"{label}_p50_us"] = statistics.median(samples) * 1e6
        out[f"{label}_p90_us"] = samples[int(0.9 * len(samples))] * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--algo", choices=["sha256", "xxh3"], action="append")
    parser.add_argument("--batches", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for algo_name in args.algo or ["sha256", "xxh3"]:
        algo = HashAlgo(algo_name)
        results[algo_name] = {**bench_ingest(algo, args.batches), **bench_score(algo, args.repeats)}
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="router index: ingestion and 8k-token scoring")
    table.add_column("metric")
    for algo_name in results:
        table.add_column(algo_name, justify="right")
    for metric in next(iter(results.values())):
        table.add_row(metric, *(f"{results[a][metric]:,.0f}" for a in results))
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
