"""Overload burst: three times the fleet's capacity, with the router's flow control on.

A fleet of its own (two emulated engines that batch few sequences, so capacity is small and
known, and a router whose flow control holds each engine to a few requests in flight and sheds
after a short wait) is measured with a closed-loop probe, then sent an open-loop burst at three
times that rate. Every request must end as a served answer or a prompt 429 with ``Retry-After``:
none may time out or fail otherwise, and the served ones' time to first token stays within the
queue deadline plus a little, instead of growing with the burst.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from dataclasses import dataclass

import aiohttp
import numpy as np

from kvmesh.chaos.bounds import ScenarioResult
from kvmesh.chaos.context import ChaosContext
from kvmesh.fleet import Fleet, FleetConfig

ENGINE_MODEL = "smollm2"
EMULATION = "tiny-h100"
MAX_NUM_SEQS = 4
"""Each engine decodes at most this many requests at once."""
IN_FLIGHT_PER_ENGINE = 6
"""The router's ``maxInFlightPerEndpoint``: the batch plus a short engine queue."""
QUEUE_DEADLINE_S = 2.0
"""The router's ``maxQueueWaitSeconds``."""
TTFT_SLACK_S = 3.0
"""Served requests' TTFT may exceed the queue deadline by this much (engine queue, a busy host)."""
BURST_FACTOR = 3.0
PROMPT_TOKENS = 256
OUTPUT_TOKENS = 96
CLIENT_TIMEOUT_S = 30.0


@dataclass(slots=True)
class Outcome:
    """One request of the burst."""

    status: int
    """HTTP status; 0 when no answer came (timeout, connection error)."""
    ttft_s: float | None = None
    retry_after: str | None = None
    error_type: str | None = None
    """The 429 body's ``error.type`` (``None`` when it was not OpenAI's error shape)."""
    queue_wait_ms: int | None = None
    failure: str | None = None


def router_yaml() -> str:
    """The scenario router's config (JSON is YAML); endpoints come from the launcher."""
    return json.dumps(
        {
            "policy": "load",
            "flowControl": {
                "enabled": True,
                "maxInFlightPerEndpoint": IN_FLIGHT_PER_ENGINE,
                "maxQueueWaitSeconds": QUEUE_DEADLINE_S,
            },
            "health": {"intervalS": 0.5, "timeoutS": 2.0, "failureThreshold": 4, "metricsIntervalS": 0.5},
        }
    )


async def _send(session: aiohttp.ClientSession, url: str, model: str, tokens: list[int]) -> Outcome:
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            wait = resp.headers.get("x-kvmesh-queue-wait-ms")
            out = Outcome(resp.status, queue_wait_ms=int(wait) if wait is not None else None)
            if resp.status == 429:
                out.retry_after = resp.headers.get("Retry-After")
                with contextlib.suppress(ValueError, aiohttp.ContentTypeError):
                    error = (await resp.json()).get("error")
                    if isinstance(error, dict) and error.get("code") == 429 and error.get("message"):
                        out.error_type = str(error.get("type"))
                return out
            if resp.status != 200:
                out.failure = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            async for line in resp.content:
                if out.ttft_s is None and line.startswith(b"data: {"):
                    out.ttft_s = time.perf_counter() - start
            if out.ttft_s is None:
                out.failure = "stream ended without output"
            return out
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Outcome(0, failure=f"{type(exc).__name__}: {exc}")


async def _capacity(
    session: aiohttp.ClientSession, url: str, model: str, prompts: list[list[int]], seconds: float
) -> float:
    """Completed requests per second with as many closed-loop workers as the router lets in."""
    done = 0
    deadline = time.perf_counter() + seconds
    cursor = iter(range(1 << 30))

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            out = await _send(session, url, model, prompts[next(cursor) % len(prompts)])
            done += out.status == 200 and out.failure is None

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(2 * IN_FLIGHT_PER_ENGINE)))
    return done / (time.perf_counter() - start)


async def _burst(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompts: list[list[int]],
    rate: float,
    seconds: float,
) -> list[Outcome]:
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[Outcome]] = []
    start = loop.time()
    n = max(1, int(rate * seconds))
    for i in range(n):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(_send(session, url, model, prompts[i % len(prompts)])))
    return list(await asyncio.gather(*tasks))


async def _flow_counter(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def overload_burst(ctx: ChaosContext) -> ScenarioResult:
    """Measure an emulated fleet's capacity, then burst at three times it through flow control.

    Bounds: no request times out or gets an answer other than 200 or 429; every 429 has a
    ``Retry-After`` of whole seconds and OpenAI's error body; some requests are shed and some
    served (the burst did overload the fleet); served requests' p99 TTFT is within the queue
    deadline plus ``TTFT_SLACK_S``.
    """
    res = ScenarioResult("overload", "8. overload burst through flow control")
    d = ctx.durations
    ctx.load.pause()  # the main fleet's load would compete for the same cores
    try:
        await ctx.load.wait_idle(10)
        run_dir = ctx.fleet.run_dir / "overload"
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = run_dir / "router.yaml"
        config_path.write_text(router_yaml())
        fleet_config = FleetConfig(
            num_engines=2,
            model=ENGINE_MODEL,
            emulate=EMULATION,
            shared="none",
            events=False,
            router_config=str(config_path),
            engine_args=["--max-num-seqs", str(MAX_NUM_SEQS)],
            run_dir=run_dir,
            stop_grace_s=5.0,
        )
        rng = random.Random(8)
        prompts = [[rng.randrange(3, 30_000) for _ in range(PROMPT_TOKENS)] for _ in range(64)]
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S, sock_connect=5)
        async with (
            Fleet(fleet_config) as fleet,
            aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session,
        ):
            url = fleet.router_url
            assert url is not None, "the overload fleet starts its router"
            async with session.get(url + "/v1/models") as resp:
                model = str((await resp.json())["data"][0]["id"])
            capacity = await _capacity(session, url, model, prompts, d.capacity_probe_s)
            rate = BURST_FACTOR * max(capacity, 1.0)
            outcomes = await _burst(session, url, model, prompts, rate, d.overload_burst_s)
            queued = await _flow_counter(session, url, "kvmesh_router_flow_queued_total")
            shed_metric = await _flow_counter(session, url, "kvmesh_router_flow_shed_total")
    finally:
        ctx.load.resume()
    served = [o for o in outcomes if o.status == 200 and o.failure is None]
    shed = [o for o in outcomes if o.status == 429]
    failed = [o for o in outcomes if o.failure is not None or o.status not in (200, 429)]
    bad_429 = [
        o
        for o in shed
        if o.retry_after is None
        or not o.retry_after.isdigit()
        or int(o.retry_after) < 1
        or o.error_type is None
    ]
    ttfts = [o.ttft_s for o in served if o.ttft_s is not None]
    p99 = float(np.quantile(ttfts, 0.99)) if ttfts else math.nan
    res.figures.update(
        capacity_rps=round(capacity, 1),
        burst_rps=round(rate, 1),
        burst_s=d.overload_burst_s,
        sent=len(outcomes),
        served=len(served),
        shed_429=len(shed),
        router_queued=int(queued),
        router_shed=int(shed_metric),
        served_ttft_p50_s=round(float(np.median(ttfts)), 3) if ttfts else "n/a",
        max_queue_wait_ms=max((o.queue_wait_ms or 0 for o in outcomes), default=0),
        retry_after_s=", ".join(sorted({o.retry_after or "-" for o in shed})),
    )
    if failed:
        res.figures["failures"] = "; ".join(sorted({o.failure or f"HTTP {o.status}" for o in failed})[:5])
    res.check("requests timed out or failed (not 200, not 429)", len(failed), "==", 0)
    res.check("429 answers without Retry-After or an OpenAI error body", len(bad_429), "==", 0)
    res.check("requests shed with 429", len(shed), ">=", 1)
    res.check("requests served", len(served), ">=", 1)
    res.check("served requests' TTFT p99", p99, "<=", QUEUE_DEADLINE_S + TTFT_SLACK_S, "s")
    return res
