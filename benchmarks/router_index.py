"""Router index benchmarks: event ingestion rate and per-request scoring cost.

    .venv/bin/python benchmarks/router_index.py [--json] [--algo sha256|xxh3]

* ingest: BlockStored batches (32 blocks of 16 tokens each, as a 512-token prefill publishes),
  chained continuations and BlockRemoved evictions from 8 pods, applied by ``EventApplier`` to an
  ``InMemoryIndex``; reported as block events per second, from pre-decoded batches and from raw
  msgpack payloads (decode included), and from payloads with the cache report's seen-block memory
  on (the router's default). The key memo is kept as the router keeps it (sha256 only). The
  ``decode_steps`` figures are a stream as engines publish while requests decode: each batch four
  one-block BlockStored events (one per request that filled a block that step, shaped as vLLM 0.32
  writes them: group, kind, medium and extra keys set), each after a one-block eviction once the
  pod is full (1,024 blocks), as vLLM interleaves them.
  Each figure is the best of ``--rounds`` runs. ``--steps`` also times each step alone (µs per
  block event): decode, and for stored blocks packing, hashing (with the memo's inputs where a
  memo is kept), memo, engine-hash map, index and seen-block memory; for removed blocks the map,
  the index and the seen-block memory.
* score: one 8k-token prompt (a u32 array, as the gateway passes it) through ``Scheduler.pick``
  with the ``precise`` preset over 8 endpoints, hashing included; cold (no pod holds block 0), half
  cached and fully cached; without and with the key memo that ingestion fills (the router's default).

Times are CPU time of this process (``time.process_time``), so other load on a shared machine
does not inflate them; ``--wall`` reports wall-clock time instead.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import random
import statistics
import sys
import time
from typing import Any

from kvmesh.core.events import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace, as_token_array, tokens_to_bytes
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.router.cache_explain import CacheReportConfig
from kvmesh.router.cache_memory import RememberingIndex, SeenBlocks
from kvmesh.router.index import MEDIUM_BITS, InMemoryIndex, MediumSet
from kvmesh.router.ingest import EventApplier
from kvmesh.router.keymemo import BlockKeyMemo, key_memo_for
from kvmesh.router.pod_blocks import PodBlocks
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


def make_decode_batches(n_batches: int, seed: int = 0) -> tuple[list[tuple[PodId, KVEventBatch]], int]:
    """Batches as engines publish them while requests decode: per batch four one-block BlockStored
    events (16 requests per pod take turns; a request ends now and then). Once a pod holds 1,024
    blocks each new block evicts its oldest: a one-block BlockRemoved before the BlockStored, in
    the order vLLM's allocation and then caching write them. Events are shaped as vLLM 0.32
    writes them (group, kind, medium and extra keys set)."""
    rng = random.Random(seed)
    out: list[tuple[PodId, KVEventBatch]] = []
    requests: dict[PodId, list[int | None]] = {p: [None] * 16 for p in PODS}
    live: dict[PodId, collections.deque[int]] = {p: collections.deque() for p in PODS}
    next_hash = 1
    n_block_events = 0
    for _ in range(n_batches):
        pod = rng.choice(PODS)
        events: list[Any] = []
        for r in rng.sample(range(16), 4):
            if len(live[pod]) >= 1024:
                events.append(BlockRemoved([live[pod].popleft()], medium="GPU", group_idx=0))
                n_block_events += 1
            tokens = [rng.randrange(40_000) for _ in range(BLOCK)]
            events.append(
                BlockStored(
                    [next_hash],
                    requests[pod][r],
                    tokens,
                    BLOCK,
                    medium="GPU",
                    extra_keys=[None],
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
            live[pod].append(next_hash)
            requests[pod][r] = None if rng.random() < 0.02 else next_hash
            next_hash += 1
            n_block_events += 1
        out.append((pod, KVEventBatch(0.0, events)))
    return out, n_block_events


CLOCK = time.process_time


def _ingest_rate(
    algo: HashAlgo,
    batches: list[tuple[PodId, KVEventBatch]],
    n_events: int,
    rounds: int,
    *,
    payloads: bool,
    seen_blocks: bool,
) -> float:
    """Block events per second, the best of ``rounds`` runs, each on a fresh applier."""
    encoded = [(pod, encode_batch(b.events, ts=0.0)) for pod, b in batches]
    best = float("inf")
    for _ in range(rounds):
        index: Any = InMemoryIndex()
        if seen_blocks:
            # The router's default: the cache report's seen-block memory fed by every index write.
            index = RememberingIndex(index, SeenBlocks(CacheReportConfig().seen_blocks))
        applier = EventApplier(index, model=MODEL, algo=algo, memo=key_memo_for(algo))
        gc.collect()
        start = CLOCK()
        if payloads:
            for pod, payload in encoded:
                applier.apply_batch(pod, decode_batch(payload))
        else:
            for pod, batch in batches:
                applier.apply_batch(pod, batch)
        best = min(best, CLOCK() - start)
    return n_events / best


def bench_ingest(algo: HashAlgo, n_batches: int, rounds: int = 3) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (batches, n_events) in (
        ("", make_batches(n_batches, algo)),
        ("_decode_steps", make_decode_batches(3 * n_batches)),
    ):
        out[f"block_events{name}"] = n_events
        for label, payloads, seen in (
            ("decoded", False, False),
            ("from_payload", True, False),
            ("from_payload_seen_blocks", True, True),
        ):
            rate = _ingest_rate(algo, batches, n_events, rounds, payloads=payloads, seen_blocks=seen)
            out[f"events_per_s{name}_{label}"] = rate
    return out


def _per(n: int, start: float) -> float:
    return (CLOCK() - start) / n * 1e6


def bench_ingest_steps(algo: HashAlgo, n_batches: int) -> dict[str, float]:
    """µs per block event of each step ``EventApplier`` takes, each timed alone on the same stream."""
    batches, n_events = make_batches(n_batches, algo)
    stored = [(pod, ev) for pod, b in batches for ev in b.events if isinstance(ev, BlockStored)]
    removed = [(pod, ev) for pod, b in batches for ev in b.events if isinstance(ev, BlockRemoved)]
    n_stored = sum(len(ev.block_hashes) for _, ev in stored)
    n_removed = sum(len(ev.block_hashes) for _, ev in removed)
    payloads = [encode_batch(b.events, ts=0.0) for _, b in batches]
    out: dict[str, float] = {}
    start = CLOCK()
    for payload in payloads:
        decode_batch(payload)
    out["step_decode_us"] = _per(n_events, start)
    start = CLOCK()
    raws = [tokens_to_bytes(ev.token_ids) for _, ev in stored]
    out["step_stored_pack_us"] = _per(n_stored, start)
    hasher = BlockHasher(Namespace(MODEL), BLOCK, algo)
    # Each batch's second event continues the first one's chain.
    start = CLOCK()
    chains: list[tuple[list[BlockKey], list[bytes]]] = []
    if key_memo_for(algo) is None:
        for i, raw in enumerate(raws):
            chains.append((hasher.hash_packed(raw, chains[-1][0][-1] if i % 2 else None), []))
        out["step_stored_hash_us"] = _per(n_stored, start)
    else:
        for i, raw in enumerate(raws):
            chains.append(hasher.hash_packed_with_inputs(raw, chains[-1][0][-1] if i % 2 else None))
        out["step_stored_hash_with_memo_inputs_us"] = _per(n_stored, start)
        memo = BlockKeyMemo()
        start = CLOCK()
        for keys, inputs in chains:
            memo.remember_inputs(inputs, keys)
        out["step_stored_memo_us"] = _per(n_stored, start)
    pods = {pod: PodBlocks(MEDIUM_BITS[Medium.GPU]) for pod in PODS}
    gpu = MediumSet(MEDIUM_BITS[Medium.GPU])
    start = CLOCK()
    for (pod, ev), (keys, _) in zip(stored, chains, strict=True):
        pods[pod].store(ev.block_hashes, keys, 0, gpu)
    out["step_stored_pod_map_us"] = _per(n_stored, start)
    index = InMemoryIndex()
    start = CLOCK()
    for (pod, _), (keys, _) in zip(stored, chains, strict=True):
        index.add(keys, pod, gpu)
    out["step_stored_index_us"] = _per(n_stored, start)
    seen = SeenBlocks(CacheReportConfig().seen_blocks)
    start = CLOCK()
    for keys, _ in chains:
        seen.note_added(keys, gpu)
    out["step_stored_seen_blocks_us"] = _per(n_stored, start)
    start = CLOCK()
    gone = [pods[pod].remove_media(ev.block_hashes, gpu).keys for pod, ev in removed]
    out["step_removed_pod_map_us"] = _per(n_removed, start)
    start = CLOCK()
    for (pod, _), keys in zip(removed, gone, strict=True):
        index.remove(keys, pod, gpu)
    out["step_removed_index_us"] = _per(n_removed, start)
    start = CLOCK()
    for keys in gone:
        seen.note_removed(keys, gpu)
    out["step_removed_seen_blocks_us"] = _per(n_removed, start)
    return out


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
    parser.add_argument("--rounds", type=int, default=3, help="ingestion runs; the best is reported")
    parser.add_argument("--steps", action="store_true", help="also time each ingestion step alone")
    parser.add_argument("--wall", action="store_true", help="wall-clock instead of CPU time")
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = time.perf_counter if args.wall else time.process_time
    results: dict[str, Any] = {}
    for algo_name in args.algo or ["sha256", "xxh3"]:
        algo = HashAlgo(algo_name)
        results[algo_name] = {
            **bench_ingest(algo, args.batches, args.rounds),
            **bench_score(algo, args.repeats),
        }
        if args.steps:
            results[algo_name].update(bench_ingest_steps(algo, args.batches))
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
        table.add_row(
            metric, *(f"{results[a][metric]:,.{3 if metric.startswith('step_') else 0}f}" for a in results)
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
