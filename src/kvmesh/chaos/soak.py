"""Soak: steady load at 80 % of measured capacity; memory and open files of every process.

Capacity is measured first with a short closed-loop burst (``concurrency`` workers back to back).
Growth is each process's median RSS over the soak's last samples against its median over the
samples just after the warm-up, so one allocator spike does not decide the run.

Open descriptors are split into TCP connections and the rest (:mod:`kvmesh.chaos.procs`). The
connections follow the load (a client pool keeps as many as were ever busy at once), so they are
held to the router's configured bound instead of to their first value: the router's connections
to each engine, at every sample. Everything else (files, pipes, event fds, ZMQ's sockets) has no
reason to grow at a steady load and is held to a small constant.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import statistics
import time

import aiohttp

from kvmesh.bench.runner import send_request
from kvmesh.chaos.bounds import ScenarioResult
from kvmesh.chaos.context import ChaosContext
from kvmesh.chaos.load import num_failed
from kvmesh.chaos.procs import ProcSample, fleet_pids, growth, sample
from kvmesh.router.endpoints import PROBE_CONNECTIONS_PER_ENDPOINT

LOAD_SHARE = 0.8
ROUTER_CONNECTIONS_PER_ENGINE = 64
"""The chaos fleet's router runs with this ``--max-connections-per-endpoint``: four times its
engines' batch (16 sequences), well under the load's 512 requests in flight."""
OTHER_FDS_GROWTH_BOUND = 8
"""Descriptors other than TCP connections a process may gain after the warm-up."""
PROBE_CONCURRENCY = 16
SAMPLE_INTERVAL_S = 1.0
SAMPLES_AVERAGED = 3


async def measure_capacity(ctx: ChaosContext, duration_s: float) -> float:
    """Completed requests per second with ``PROBE_CONCURRENCY`` closed-loop workers (load paused)."""
    ctx.load.pause()
    await ctx.load.wait_idle(10)
    specs = itertools.cycle(ctx.prompts)
    counter = itertools.count()
    done = 0
    deadline = time.perf_counter() + duration_s
    timeout = aiohttp.ClientTimeout(total=30)
    connector = aiohttp.TCPConnector(limit=PROBE_CONCURRENCY)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                spec = dataclasses.replace(next(specs), request_id=f"capacity-{next(counter)}")
                result = await send_request(session, spec, ctx.load.options, ctx.log.t0)
                done += result.ok

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(PROBE_CONCURRENCY)))
        elapsed = time.perf_counter() - start
    ctx.load.resume()
    return done / elapsed


def _median(samples: list[dict[str, ProcSample]], name: str, attr: str) -> int | None:
    values = [getattr(s[name], attr) for s in samples if name in s and getattr(s[name], attr) is not None]
    return int(statistics.median(values)) if values else None


def _most_router_connections(samples: list[dict[str, ProcSample]], engine_ports: list[int]) -> float:
    """The most connections the router held to any one engine at any sample (``nan``: unread)."""
    counts = [s["router"].connections_to(port) for s in samples if "router" in s for port in engine_ports]
    if not counts or any(c is None for c in counts):
        return float("nan")
    return float(max(c for c in counts if c is not None))


async def soak(ctx: ChaosContext) -> ScenarioResult:
    """Run ``durations.soak_s`` at 80 % of capacity, sampling every process each second.

    Bounds: no failed request; no process's RSS grows by ``rss_growth_bound`` or more after the
    warm-up (5 % in the full run); the router never holds more connections to one engine than its
    bound plus the health checks' own; no process gains more than ``OTHER_FDS_GROWTH_BOUND``
    descriptors that are not TCP connections.
    """
    res = ScenarioResult("soak", "7. soak at 80 % of capacity")
    d = ctx.durations
    capacity = await measure_capacity(ctx, d.capacity_probe_s)
    old_rate, old_fresh = ctx.load.rate, ctx.load.fresh_every
    ctx.load.rate = max(1.0, LOAD_SHARE * capacity)
    # Only the cycled prompts: fresh ones would fill the caches up to their budgets, which is
    # growth by design and would hide a leak's.
    ctx.load.fresh_every = 0
    pids = fleet_pids(ctx.fleet)
    engine_ports = [e.port for e in ctx.fleet.engines]
    start = ctx.log.now()
    samples: list[tuple[float, dict[str, ProcSample]]] = []
    while ctx.log.now() - start < d.soak_s:
        samples.append((ctx.log.now() - start, sample(pids)))
        await asyncio.sleep(SAMPLE_INTERVAL_S)
    end = ctx.log.now()
    ctx.load.rate, ctx.load.fresh_every = old_rate, old_fresh
    await ctx.load.wait_idle(10)
    after_warmup = [s for t, s in samples if t >= d.soak_warmup_s][:SAMPLES_AVERAGED]
    last = [s for _, s in samples[-SAMPLES_AVERAGED:]]
    results = ctx.load.window(start, end)
    res.figures.update(
        capacity_rps=round(capacity, 1),
        soak_rate_rps=round(LOAD_SHARE * capacity, 1),
        soak_requests=len(results),
        soak_s=round(end - start, 1),
    )
    growths: list[float] = []
    other_growths: list[float] = []
    for name in pids:
        first_rss, last_rss = _median(after_warmup, name, "rss_bytes"), _median(last, name, "rss_bytes")
        g = growth(first_rss, last_rss)
        res.figures[f"{name}_rss_mib"] = round((last_rss or 0) / 2**20, 1)
        res.figures[f"{name}_rss_growth_pct"] = round(100 * g, 2)
        for attr, label in (("open_fds", "fds"), ("num_connections", "tcp"), ("num_other_fds", "other_fds")):
            res.figures[f"{name}_{label}"] = (
                f"{_median(after_warmup, name, attr)} -> {_median(last, name, attr)}"
            )
        first_other, last_other = (
            _median(after_warmup, name, "num_other_fds"),
            _median(last, name, "num_other_fds"),
        )
        other_growths.append(
            float("nan") if first_other is None or last_other is None else float(last_other - first_other)
        )
        growths.append(g)
    # a process that could not be measured (nan) makes the bound fail
    worst = float("nan") if any(math.isnan(g) for g in growths) else max(growths, default=float("nan"))
    worst_other = (
        float("nan")
        if any(math.isnan(g) for g in other_growths)
        else max(other_growths, default=float("nan"))
    )
    res.check("failed requests", num_failed(results), "==", 0)
    res.check("largest RSS growth after warm-up", 100 * worst, "<", 100 * d.rss_growth_bound, "%")
    res.check(
        "most router connections to one engine",
        _most_router_connections([s for _, s in samples], engine_ports),
        "<=",
        ROUTER_CONNECTIONS_PER_ENGINE + PROBE_CONNECTIONS_PER_ENDPOINT,
    )
    res.check("largest growth of other descriptors after warm-up", worst_other, "<=", OTHER_FDS_GROWTH_BOUND)
    return res
