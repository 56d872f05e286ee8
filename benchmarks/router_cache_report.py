"""What cache reporting (``x-kvmesh-cache``, ``/admin/explain``, per-tenant usage) costs the router.

    .venv/bin/python benchmarks/router_cache_report.py [--requests 20000] [--batches 3000] [--json]

* per request: ``CacheReporter.begin`` + ``finish`` for a 2k-token prompt routed by the ``precise``
  preset over 4 endpoints, next to ``Scheduler.pick`` for the same prompt: a token-id prompt the
  engine served but its last block (``partial_block``), one it missed (``cold``: the key of the
  first missed block is computed), and a chat prompt with ~2,000 characters of text (fingerprinted);
* ingest: BlockStored batches (32 blocks of 16 tokens, chained, from 8 pods) applied by
  ``EventApplier`` to an ``InMemoryIndex`` directly and through ``RememberingIndex`` (which feeds
  the memory of seen blocks), as block events per second.

Times are CPU time of this process (``time.process_time``), best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from typing import Any

from kvmesh.core.cache_usage import CacheUsage
from kvmesh.core.events import BlockStored
from kvmesh.core.hashing import HashAlgo, Namespace, as_token_array
from kvmesh.core.types import ExternalBlockHash, PodId
from kvmesh.router.cache_explain import CacheReportConfig
from kvmesh.router.cache_memory import RememberingIndex, SeenBlocks, prompt_texts
from kvmesh.router.cache_report import CacheReporter
from kvmesh.router.index import BlockIndex, InMemoryIndex
from kvmesh.router.ingest import EventApplier
from kvmesh.router.scheduler import Scheduler, load_scheduler_config
from kvmesh.router.types import EndpointState, RoutingRequest

PROMPT_TOKENS = 2048
TEXT = "You are a careful assistant; answer from the attached contract only. " * 30


def best_of(repeats: int, fn: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def per_request(n: int, repeats: int) -> dict[str, float]:
    scheduler = Scheduler.from_config(
        load_scheduler_config("precise"), index=InMemoryIndex(1_000_000), hash_algo=HashAlgo.XXH3
    )
    reporter = CacheReporter(CacheReportConfig(), scheduler, lambda pod: 16)
    reporter.seen.note_added([bytes(16)], 1)  # a non-empty memory: a miss computes its key
    endpoints = [EndpointState(PodId(f"http://e{i}:8000")) for i in range(4)]
    rng = random.Random(1)
    tokens = as_token_array([rng.randrange(50_000) for _ in range(PROMPT_TOKENS)])
    namespace = Namespace("bench", "")
    routing = RoutingRequest("r", tokens, namespace)
    decision = scheduler.pick(routing, endpoints)
    assert decision is not None
    served = CacheUsage(
        (PROMPT_TOKENS - 1) // 16 * 16, PROMPT_TOKENS, {"GPU": (PROMPT_TOKENS - 1) // 16 * 16}
    )
    chat = prompt_texts({"messages": [{"role": "user", "content": TEXT}]}, chat=True)

    def pick() -> None:
        for _ in range(n):
            scheduler.pick(RoutingRequest("r", tokens, namespace), endpoints)

    def report(usage: CacheUsage, texts: list[str]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(n):
                note = reporter.begin(reporter.request_id(None), "", routing, decision, texts)
                reporter.finish(note, decision.endpoint, usage)

        return run

    return {
        "pick_us": best_of(repeats, pick) / n * 1e6,
        "report_hit_us": best_of(repeats, report(served, [])) / n * 1e6,
        "report_cold_us": best_of(repeats, report(CacheUsage(0, PROMPT_TOKENS), [])) / n * 1e6,
        "report_chat_text_us": best_of(repeats, report(served, chat)) / n * 1e6,
    }


def ingest(num_batches: int, repeats: int) -> dict[str, float]:
    rng = random.Random(2)
    pods = [PodId(f"http://e{i}:8000") for i in range(8)]
    batches: list[tuple[PodId, BlockStored]] = []
    next_hash = 1
    for b in range(num_batches):
        hashes: list[ExternalBlockHash] = list(range(next_hash, next_hash + 32))
        next_hash += 32
        tokens = [rng.randrange(50_000) for _ in range(32 * 16)]
        batches.append((pods[b % len(pods)], BlockStored(hashes, None, tokens, 16)))

    def applying(wrap: Callable[[BlockIndex], BlockIndex]) -> Callable[[], None]:
        def run() -> None:
            applier = EventApplier(wrap(InMemoryIndex(10_000_000)), model="bench", algo=HashAlgo.XXH3)
            for pod, event in batches:
                applier.apply(pod, event)

        return run

    blocks = num_batches * 32
    direct = best_of(repeats, applying(lambda index: index))
    remembering = best_of(repeats, applying(lambda index: RememberingIndex(index, SeenBlocks(262_144))))
    return {"direct_blocks_per_s": blocks / direct, "remembering_blocks_per_s": blocks / remembering}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--batches", type=int, default=3_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "per_request": per_request(args.requests, args.repeats),
        "ingest": ingest(args.batches, args.repeats),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    r, i = result["per_request"], result["ingest"]
    print(f"Scheduler.pick, {PROMPT_TOKENS}-token prompt, 4 endpoints: {r['pick_us']:.1f} us")
    print(
        f"cache report per request: hit {r['report_hit_us']:.1f} us, cold miss {r['report_cold_us']:.1f} us, "
        f"chat text {r['report_chat_text_us']:.1f} us"
    )
    print(
        f"ingest: {i['direct_blocks_per_s']:,.0f} block events/s direct, "
        f"{i['remembering_blocks_per_s']:,.0f} through RememberingIndex"
    )


if __name__ == "__main__":
    main()
