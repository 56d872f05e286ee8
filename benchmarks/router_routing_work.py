"""The router's own work per request, in process, and a digest of every decision it made.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/router_routing_work.py [--passes 5] [--trace out.json]

Drives a :class:`~kvmesh.router.gateway.Gateway`'s per-request steps in the order its handler runs
them, without HTTP: parse (tokenize), flow-control admission (index match), pick, the cache note,
the prefill ledger, and settling the note with the engine's usage. Two parts:

* **trace**: 1,200 varied requests (text, chat and token-id prompts, tenants, sessions, endpoint
  loads drawn at random, blocks added to the index, first tokens, engine-reported cache hits);
  everything the router decides or sends (ranking, scores and their terms, predicted hits, the
  ``x-kvmesh-cache`` header, the forwarded body, tenant, namespace, the leading ids) is hashed into
  one digest. Two source trees that route alike print the same digest (run each with
  ``PYTHONPATH=TREE/src``; ``--trace`` writes the records to compare them one by one).
* **routing work**: the process CPU time per request of the benchmark's own shape
  (``router_gateway.py``'s ~500-token text prompts, 3 idle endpoints, every prompt's ids cached
  after a first pass), the least of ``--passes`` passes over 2,000 prompts.

The HTTP server, the upstream call and the event loop are not in this figure
(``router_cpu_profile.py`` measures the whole process).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from multidict import CIMultiDict, CIMultiDictProxy

sys.path.insert(0, str(Path(__file__).resolve().parent))

from router_gateway import MODEL, make_prompts

from kvmesh.core.cache_usage import CacheUsage
from kvmesh.core.tokens import Tokenizer
from kvmesh.core.types import Medium
from kvmesh.router.cache_memory import prompt_texts
from kvmesh.router.config import RouterConfig
from kvmesh.router.first_miss import whole_prompt_needed
from kvmesh.router.gateway import Gateway
from kvmesh.router.index import medium_set
from kvmesh.router.types import EndpointState


def _headers(i: int) -> CIMultiDictProxy[str]:
    items = {
        "Content-Type": "application/json",
        "Host": "router",
        "Accept": "*/*",
        "Authorization": "Bearer t",
    }
    if i % 3:
        items["x-session-id"] = f"s{i % 7}"
    if i % 5 == 0:
        items["x-tenant-id"] = "acme"
    return CIMultiDictProxy(CIMultiDict(items))


async def route_all(
    gw: Gateway,
    states: list[EndpointState],
    bodies: list[tuple[bytes, bool]],
    seed: int,
    trace: list[Any] | None,
) -> None:
    """Route ``bodies`` (raw body, is chat) as the gateway's handler would; with ``trace``, vary the
    endpoints and the engines' answers and record what was decided."""
    rng = random.Random(seed)
    gate = gw.flow_gate
    assert gate is not None, "the default config has flow control on"
    gate.start(lambda: states)  # no queue forms here: its tick loop never wakes
    until_first_miss = not whole_prompt_needed(gw.scheduler)
    headers = [_headers(i) for i in range(16)]
    ledger = gw.prefill_ledger
    for i, (raw, chat) in enumerate(bodies):
        if trace is not None:
            for s in states:
                s.waiting, s.running = rng.randrange(4), rng.randrange(50)
                s.kv_cache_usage, s.in_flight = rng.random(), rng.randrange(8)
        parsed = await gw.parser.parse(
            raw,
            headers[i % 16],
            chat=chat,
            model=gw.model,
            revision=gw.revision,
            until_first_miss=until_first_miss,
        )
        routing = parsed.routing
        if trace is not None and rng.random() < 0.4 and len(routing.tokens) >= 16:
            keys = gw.scheduler.hasher(routing.namespace).hash_blocks(routing.tokens)
            held = keys[: rng.randrange(1, len(keys) + 1)]
            gw.index.add(held, rng.choice(states).pod, medium_set(rng.choice([Medium.GPU, Medium.CPU])))
        ticket = await gate.admit(routing, tenant=parsed.tenant, priority=0, max_wait_s=None, request=None)
        decision = gw._pick(routing, gate.endpoints_for(ticket, states))
        gate.release(ticket)
        assert decision is not None and routing.prefix is not None
        note = gw.cache_report.begin(
            gw.cache_report.request_id(None),
            parsed.tenant,
            routing,
            decision,
            prompt_texts(parsed.body, chat=chat),
        )
        pod = decision.endpoint
        state = next(s for s in states if s.pod == pod)
        hit = routing.prefix.hit_tokens(pod)
        now = 1000.0 + i * 0.001
        ledger.sent(routing.request_id, state, routing.num_tokens - hit, now, cached=hit)
        if trace is not None and rng.random() < 0.5:
            ledger.first_token(routing.request_id, now + 0.0005)
        ledger.finished(routing.request_id)
        ledger.released(routing.request_id, state, routing.num_tokens, now + 0.0007)
        cached = rng.choice([0, hit, max(hit - 16, 0), routing.num_tokens]) if trace is not None else 0
        usage = {"prompt_tokens": routing.num_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
        header = gw.cache_report.finish(note, pod, CacheUsage.from_usage(usage)).header_value()
        if trace is not None:
            terms = decision.terms
            trace.append(
                [pod, decision.ranked, {k: round(v, 12) for k, v in decision.scores.items()},
                 decision.predicted_hit_tokens, None if terms is None else [terms.candidates, terms.names, terms.columns],
                 header, parsed.raw.decode(), parsed.tenant, routing.session_id,
                 [int(t) for t in routing.tokens[:8]], int(routing.num_tokens), routing.namespace.label()]
            )  # fmt: skip
    await gate.aclose()


def new_gateway() -> tuple[Gateway, list[EndpointState]]:
    """A gateway with the default config (precise preset, SmolLM2's tokenizer) and 3 idle endpoints."""
    gw = Gateway(RouterConfig(model=MODEL, tokenizer="smollm2", seed=7), tokenizer=Tokenizer.load("smollm2"))
    return gw, [EndpointState(pod=f"http://127.0.0.1:{9000 + i}") for i in range(3)]


def trace_bodies() -> list[tuple[bytes, bool]]:
    rng = random.Random(1)
    bodies = []
    for i, prompt in enumerate(make_prompts(600)):
        if i % 4 == 3:
            messages = [
                {"role": "system", "content": prompt[:1500]},
                {"role": "user", "content": prompt[1500:]},
            ]
            bodies.append(
                (msgspec.json.encode({"model": MODEL, "messages": messages, "max_tokens": 1}), True)
            )
        elif i % 10 == 5:
            ids = [rng.randrange(1000, 30000) for _ in range(300)]
            bodies.append((msgspec.json.encode({"model": MODEL, "prompt": ids, "max_tokens": 1}), False))
        else:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": False}
            bodies.append((msgspec.json.encode(body), False))
    return bodies


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--trace", type=Path, default=None, help="write the decision records here (JSON)")
    parser.add_argument("--skip-trace", action="store_true", help="only the routing work")
    args = parser.parse_args(argv)
    trace: list[Any] = []
    if not args.skip_trace:
        gw, states = new_gateway()
        bodies = trace_bodies()
        await route_all(gw, states, bodies, 0, trace)
        await route_all(gw, states, bodies, 1, trace)  # the same prompts again: cached ids, a fuller index
        digest = hashlib.sha256(json.dumps(trace).encode()).hexdigest()
        print(f"decisions digest {digest[:16]} ({len(trace)} requests)")
        if args.trace is not None:
            args.trace.write_text(json.dumps(trace))
    gw, states = new_gateway()
    bench = [
        (msgspec.json.encode({"model": MODEL, "prompt": p, "max_tokens": 1}), False)
        for p in make_prompts(2000)
    ]
    await route_all(gw, states, bench, 5, None)  # tokenize and learn the shared starts once
    best = float("inf")
    for k in range(args.passes):
        start = time.process_time()
        await route_all(gw, states, bench, 6 + k, None)
        best = min(best, time.process_time() - start)
    print(
        f"routing work {1e6 * best / len(bench):.1f} us/request (least of {args.passes} passes of {len(bench)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
