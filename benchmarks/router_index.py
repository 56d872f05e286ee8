"""Router index benchmarks: event ingestion rate and per-request scoring cost.

    .venv/bin/python benchmarks/router_index.py [--json] [--algo sha256|xxh3]

* ingest: BlockStored batches (32 blocks of 16 tokens each, as a 512-token prefill publishes),
  chained continuations and BlockRemoved evictions from 8 pods, applied by ``EventApplier`` to an
  ``InMemoryIndex``; reported as block events per second, from pre-decoded batches and from raw
  msgpack payloads (decode included).
* score: one 8k-token prompt (a u32 array, as the gateway passes it) through ``Scheduler.pick``
  with the ``precise`` preset over 8 endpoints, hashing included; cold (no pod holds block 0), half
  cached and fully cached; without and with the key memo that ingestion fills (the router's default).

Times are CPU time of this process (``time.process_time``), so other load on a shared machine
does not inflate them; ``--wall`` reports wall-clock time instead.
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
from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace, as_token_array
from kvmesh.core.types import PodId
from kvmesh.router.index import InMemoryIndex
from kvmesh.router.ingest import EventApplier
from kvmesh.router.keymemo import BlockKeyMemo
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


CLOCK = time.process_time


def bench_ingest(algo: HashAlgo, n_batches: int) -> dict[str, float]:
    batches, n_events = make_batches(n_batches, algo)
    applier = EventApplier(InMemoryIndex(), model=MODEL, algo=algo, memo=BlockKeyMemo())
    start = CLOCK()
    for pod, batch in batches:
        applier.apply_batch(pod, batch)
    decoded_s = CLOCK() - start

    payloads = [(pod, encode_batch(b.events, ts=0.0)) for pod, b in batches]
    applier = EventApplier(InMemoryIndex(), model=MODEL, algo=algo, memo=BlockKeyMemo())
    start = CLOCK()
    for pod, payload in payloads:
        applier.apply_batch(pod, decode_batch(payload))
    raw_s = CLOCK() - start
    return {
        "block_events": n_events,
        "events_per_s_decoded": n_events / decoded_s,
        "events_per_s_from_payload": n_events / raw_s,
    }


def bench_score(algo: HashAlgo, repeats: int) -> dict[str, float]:
    """Scheduler.pick on an 8k-token prompt; the index is built from BlockStored events."""
    rng = random.Random(1)
    # the gateway hands the scheduler its prompt as one u32 array, converted once per request
    prompt = as_token_array([rng.randrange(40_000) for _ in range(8192)])
    ns = Namespace(MODEL)
    endpoints = [EndpointState(p, waiting=1, kv_cache_usage=0.2) for p in PODS]
    out: dict[str, float] = {}
    cases = (("cold", {}), ("half", {PODS[2]: 256, PODS[5]: 64}), ("full", {PODS[3]: 512, PODS[1]: 300}))
    for use_memo in (False, True):
        for label, holders in cases:
            memo = BlockKeyMemo() if use_memo else None
            index = InMemoryIndex()
            applier = EventApplier(index, model=MODEL, algo=algo, memo=memo)
            for pod, n in holders.items():
                applier.apply(pod, BlockStored(list(range(n)), None, prompt[: n * BLOCK].tolist(), BLOCK))
            scheduler = Scheduler.from_config(
                load_scheduler_config("precise"), index=index, hash_algo=algo, rng=random.Random(0), memo=memo
            )
            samples = []
            for i in range(repeats):
                request = RoutingRequest(f"r{i}", prompt, ns)
                start = CLOCK()
                decision = scheduler.pick(request, endpoints)
                samples.append(CLOCK() - start)
                assert decision is not None
                assert decision.predicted_hit_tokens == max(holders.values(), default=0) * BLOCK
            samples.sort()
            name = f"{label}{'_memo' if use_memo else ''}"
            out[f"{name}_p50_us"] = statistics.median(samples) * 1e6
            out[f"{name}_p90_us"] = samples[int(0.9 * len(samples))] * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--algo", choices=["sha256", "xxh3"], action="append")
    parser.add_argument("--batches", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--wall", action="store_true", help="wall-clock instead of CPU time")
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = time.perf_counter if args.wall else time.process_time
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
