"""Routing a ~98k-token prompt: full tokenization against tokenizing until the first miss.

    .venv/bin/python benchmarks/router_first_miss.py [--json] [--repeats 5]

One SmolLM2 tokenizer (``CachedTokenizer``) and a ``precise`` scheduler over an in-memory index;
each case routes fresh prompts (new text each repeat, so no exact-input cache helps) and reports
the median CPU time (``time.process_time``) of tokenizing and matching one prompt:

* ``novel``: no cache holds any of the prompt;
* ``shared``: a pod holds the prompt's first ~40k tokens (a shared document), the rest is new;
  the first such prompt teaches the router the held part, later ones start after it;
* ``seen``: every prompt is one ~98k-token system prompt and a short question, and no cache holds
  any of it (``router_gateway.py --prompt-tokens 79500`` against its mock engines): the second
  prompt teaches the router the shared start.

``full`` is the gateway's path for every prompt (``CachedTokenizer.encode_ids`` then ``Scheduler.match``),
``first-miss`` is :func:`kvmesh.router.first_miss.tokenize_until_miss`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np

from kvmesh.core.hashing import HashAlgo, Namespace, as_token_array
from kvmesh.core.tokens import Tokenizer
from kvmesh.core.types import Medium, PodId
from kvmesh.router.first_miss import LongPrompt, tokenize_until_miss
from kvmesh.router.index import InMemoryIndex, medium_set
from kvmesh.router.scheduler import Scheduler, load_scheduler_config
from kvmesh.router.tokenize import CachedTokenizer
from kvmesh.router.types import RoutingRequest

NAMESPACE = Namespace("smollm2")
_LOOP = asyncio.new_event_loop()
"""One loop for every call, as in the router (its worker threads stay up between calls)."""
WORDS = ["river", "mountain", "weather", "stone", "valley", "rain", "über", "42", "north,", "sea."]


def document(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


def timed_full(tok: CachedTokenizer, sched: Scheduler, text: str) -> float:
    start = time.process_time()
    ids = tok.encode_ids(text)  # what the gateway calls: u32 ids and the learnt prefix they start with
    assert ids is not None
    routing = RoutingRequest("r", ids.array, NAMESPACE, known_prefix=ids.known)
    sched.match(routing)
    return time.process_time() - start


def timed_first_miss(tok: CachedTokenizer, sched: Scheduler, text: str) -> float:
    start = time.process_time()
    routing = RoutingRequest("r", as_token_array([]), NAMESPACE)
    _LOOP.run_until_complete(tokenize_until_miss(LongPrompt(text, True, tok), routing, sched, off_loop=False))
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = Tokenizer.load("smollm2")
    system = document(30_000, 1)
    results: dict[str, dict[str, float]] = {}
    seen_system = document(58_000, 2)
    for case in ("novel", "shared", "seen"):
        for path, timed in (("full", timed_full), ("first-miss", timed_first_miss)):
            tok = CachedTokenizer(base)
            sched = Scheduler.from_config(
                load_scheduler_config("precise"),
                index=InMemoryIndex(),
                block_size=16,
                hash_algo=HashAlgo.XXH3,
            )
            if case == "shared":
                held = tok.encode_piece(system, True)
                keys = sched.hasher(NAMESPACE).hash_blocks(as_token_array(held))
                assert sched.index is not None
                sched.index.add(keys, PodId("http://a:1"), medium_set(Medium.GPU))
            times = []
            for i in range(args.repeats + 2):
                if case == "seen":
                    text = f"{seen_system} Question {i}: what is {i * 7919} squared?"
                else:
                    tail = document(58_000 if case == "novel" else 28_000, 100 + i)
                    text = tail if case == "novel" else system + " Question: " + tail
                t = timed(tok, sched, text)
                if i > 1:  # the first two prompts teach the shared part to either path
                    times.append(t)
            results.setdefault(case, {})[path] = statistics.median(times) * 1000
    if args.json:
        print(json.dumps(results))
        return
    for case, by_path in results.items():
        ratio = by_path["full"] / by_path["first-miss"]
        print(
            f"{case:7s} full {by_path['full']:8.2f} ms   first-miss {by_path['first-miss']:7.2f} ms   {ratio:6.1f}x"
        )


if __name__ == "__main__":
    main()
