"""Write a coding-agent stand-in trace in Mooncake format (for the trace-memory benchmark).

    .venv/bin/python benchmarks/make_agentic_trace.py /tmp/agentic_trace.jsonl.gz

64 sessions of 51–68 turns over about 70 minutes. Every prompt resends its session's context as
512-token hash-id blocks: a system prompt shared by all sessions (12 blocks), 80–140 blocks of
repository context, then 2–7 new blocks a turn. Half the turns also rewrite the last 8–64 blocks
(edits, retries), and a context that would pass 128k tokens is compacted to the system prompt plus
60–120 fresh blocks. Turns are 20–75 s apart. The result: 3,817 requests, 342M prompt tokens (mean
89.6k), 97,364 distinct blocks (50M tokens, twice the 24M of 8 × 3M-token pods), so the fleet's
caches fill and evict. Same seed, same file.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path
from typing import Any

BLOCK = 512
CAP = 128_000
SYSTEM_BLOCKS = 12


def make_trace(seed: int = 7, sessions: int = 64, rewind: float = 0.5) -> list[dict[str, Any]]:
    """The trace's records, in timestamp order."""
    rng = random.Random(seed)
    next_id = 0

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    system = new_ids(SYSTEM_BLOCKS)
    records: list[dict[str, Any]] = []
    for _ in range(sessions):
        t = rng.uniform(0, 1200) * 1000
        turns = rng.randint(51, 68)
        ids = system + new_ids(rng.randint(80, 140))
        for _ in range(turns):
            n = min(len(ids) * BLOCK - rng.randint(1, BLOCK - 1), CAP)
            records.append(
                {
                    "timestamp": int(t),
                    "input_length": n,
                    "output_length": rng.randint(100, 1200),
                    "hash_ids": ids[: -(-n // BLOCK)],
                }
            )
            t += rng.uniform(20, 75) * 1000
            grow = new_ids(rng.randint(2, 7))
            if rng.random() < rewind:
                r = min(rng.randint(8, 64), len(ids) - SYSTEM_BLOCKS - 8)
                ids = ids[: len(ids) - r] + new_ids(r)
            if (len(ids) + len(grow)) * BLOCK > CAP + 6 * BLOCK:
                ids = system + new_ids(rng.randint(60, 120))
            else:
                ids = ids + grow
    records.sort(key=lambda r: r["timestamp"])
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="where to write the .jsonl.gz")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    records = make_trace(args.seed)
    with gzip.open(args.out, "wt") as handle:
        for rec in records:
            handle.write(json.dumps(rec) + "\n")
    tokens = sum(r["input_length"] for r in records)
    blocks = len({h for r in records for h in r["hash_ids"]})
    print(f"{len(records)} requests, {tokens / 1e6:.1f}M prompt tokens (mean {tokens / len(records):,.0f}), "
          f"{blocks:,} distinct blocks")  # fmt: skip


if __name__ == "__main__":
    main()
