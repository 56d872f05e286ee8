"""Cache hits by routing policy, against an oracle, on real emulated engine processes.

    .venv/bin/python benchmarks/router_hits.py [--engines 3] [--groups 40] [--visits 3] [--json]

Starts ``--engines`` ``kvmesh engine --emulate tiny-h100`` processes (KV events on, real prefix
caches) and, for each policy, a fresh router in front of them. The workload: ``--groups`` shared
prefixes of 256 tokens, each requested ``--visits`` times with distinct 20-token suffixes, in a
seeded random order (each policy gets its own token range, so caches never carry over between
policies). Realized hits are the engines' ``usage.prompt_tokens_details.cached_tokens``; the oracle
knows every cache and gets the full prefix on every visit after the first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import selectors
import subprocess
import sys
import time
from typing import Any

from kvmesh.core.net import free_port

PREFIX = 256
SUFFIX = 20
POLICIES = ("precise", "approximate", "load", "round-robin", "random")


def start_engines(n: int) -> list[tuple[subprocess.Popen[bytes], str]]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvmesh",
                "engine",
                "--model",
                "smollm2",
                "--emulate",
                "tiny-h100",
                "--port",
                "0",
                "--events",
                "tcp://127.0.0.1:0",
                "--events-replay",
                "tcp://127.0.0.1:0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        for _ in range(n)
    ]
    urls: dict[int, str] = {}
    sel = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        sel.register(p.stdout, selectors.EVENT_READ, i)  # type: ignore[arg-type]
    deadline = time.monotonic() + 300
    while len(urls) < n:
        if time.monotonic() > deadline:
            raise TimeoutError("engines did not start")
        for key, _ in sel.select(5):
            line = procs[key.data].stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError("an engine exited during startup")
            urls[key.data] = json.loads(line)["url"]
            sel.unregister(key.fileobj)
    return [(procs[i], urls[i]) for i in range(n)]


def workload(run: int, groups: int, visits: int, seed: int) -> list[tuple[int, list[int]]]:
    """Prefix g of run r starts with tokens (1000 + r, 2000 + g): chains never meet across runs."""
    rng = random.Random(seed)
    order = [g for g in range(groups) for _ in range(visits)]
    rng.shuffle(order)
    out = []
    for n, g in enumerate(order):
        prefix = [1000 + run, 2000 + g, *range(10_000, 10_000 + PREFIX - 2)]
        out.append((g, prefix + [20_000 + (n * SUFFIX + i) % 20_000 for i in range(SUFFIX)]))
    return out


async def run_policy(urls: list[str], policy: str, run: int, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    from aiohttp import web

    from kvmesh.router.config import router_config_from_dict
    from kvmesh.router.gateway import ENDPOINT_HEADER, Gateway

    gw = Gateway(
        router_config_from_dict({"endpoints": [{"url": u} for u in urls], "policy": policy, "seed": 1})
    )
    runner = web.AppRunner(gw.app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    deadline = time.monotonic() + 30
    while gw.intake is None or len(gw.intake.sources) < len(urls):
        if time.monotonic() > deadline:
            raise TimeoutError("router did not subscribe to every engine")
        await asyncio.sleep(0.05)
    realized = oracle = 0
    seen: set[int] = set()
    endpoints: dict[str, int] = {}
    async with aiohttp.ClientSession() as session:
        for group, prompt in workload(run, args.groups, args.visits, seed=7):
            async with session.post(
                f"http://127.0.0.1:{port}/v1/completions", json={"prompt": prompt, "max_tokens": 2}
            ) as resp:
                body = await resp.json()
                endpoint = resp.headers[ENDPOINT_HEADER]
            realized += body["usage"]["prompt_tokens_details"]["cached_tokens"]
            oracle += PREFIX if group in seen else 0
            seen.add(group)
            endpoints[endpoint] = endpoints.get(endpoint, 0) + 1
            await asyncio.sleep(args.gap_ms / 1000)
    await runner.cleanup()
    return {
        "realized_hit_tokens": realized,
        "oracle_hit_tokens": oracle,
        "share_of_oracle": realized / oracle if oracle else 0.0,
        "requests_per_engine": sorted(endpoints.values(), reverse=True),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--visits", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=20.0, help="pause between requests")
    parser.add_argument("--policy", action="append", choices=POLICIES)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    engines = start_engines(args.engines)
    results: dict[str, Any] = {}
    try:
        urls = [u for _, u in engines]
        for run, policy in enumerate(args.policy or POLICIES):
            results[policy] = asyncio.run(run_policy(urls, policy, run, args))
    finally:
        for p, _ in engines:
            p.terminate()
        for p, _ in engines:
            p.wait(timeout=20)
    if args.json:
        json.dump({"config": vars(args), "results": results}, sys.stdout, indent=2)
        print()
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"cache hits by policy: {args.engines} engines, {args.groups} prefixes × {args.visits} visits"
    )
    for col in ("policy", "hit tokens", "oracle", "share of oracle", "requests per engine"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for policy, r in results.items():
        table.add_row(
            policy, f"{r['realized_hit_tokens']:,}", f"{r['oracle_hit_tokens']:,}",
            f"{r['share_of_oracle']:.1%}", " / ".join(map(str, r["requests_per_engine"])),
        )  # fmt: skip
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
