"""Rolling restart under load: every router worker, one at a time, then every engine, one at a time.

The router runs as ``kvmesh router --workers 2``: two routers behind one port, the kernel as their
load balancer, each with its own event intake. A worker is stopped (SIGTERM: it finishes what it
holds), the supervisor starts it again, and the next one goes only once the new one listens and has
had :data:`SETTLE_S` to replay the engines' events. Then each engine is restarted the same way: its
event sequence starts again at 0, so every router drops its blocks (incarnation fencing) and learns
them anew.

A *decision without cache data* is a request for a prompt the fleet has already served (one of the
load's shared-prefix prompts, not a fresh one) that was served with no cached token at all for a
reason the router owns: it had no entry for the prompt anywhere, or sent it where there was none
(the router's ``x-kvmesh-cache`` reason is anything but ``store_fault``). A request whose engine
could not read a prompt the router routed right (``store_fault``: the shared tier's read failed or
timed out, and the engine recomputed) is counted apart, as a figure: the store's faults have their
own scenarios and bounds.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Sequence

from kvmesh.bench.metrics import RequestResult
from kvmesh.chaos.bounds import ScenarioResult
from kvmesh.chaos.context import ChaosContext, poll_until
from kvmesh.chaos.load import failure_kinds, hit_rate, num_failed
from kvmesh.core.cache_usage import header_fields
from kvmesh.errors import FleetError
from kvmesh.router.workers import num_listening_sockets, worker_pids

NUM_ROUTER_WORKERS = 2
SETTLE_S = 1.5
"""After a restarted process answers: time for replay and health checks before the next goes."""
WORKER_START_TIMEOUT_S = 120.0
BLIND_SHARE_BOUND = 0.01
HIT_RATE_GAP_BOUND = 0.02


STORE_FAULT = "store_fault"


def served_without_cache(results: Sequence[RequestResult]) -> list[RequestResult]:
    """Successful requests for an already-served prompt that got no cached token."""
    return [r for r in results if r.ok and r.group is not None and r.cached_tokens == 0]


def decisions_without_cache_data(results: Sequence[RequestResult]) -> int:
    """Those of :func:`served_without_cache` the router's miss reason does not lay on the store."""
    return sum(1 for r in served_without_cache(results) if miss_reason(r.cache_note) != STORE_FAULT)


def reasons_without_cache(results: Sequence[RequestResult]) -> str:
    """:func:`served_without_cache` counted by the router's miss reason, as ``reason:n,...``."""
    reasons = Counter(miss_reason(r.cache_note) for r in served_without_cache(results))
    return ",".join(f"{reason}:{n}" for reason, n in reasons.most_common())


def miss_reason(note: str | None) -> str:
    """The ``reason`` of an ``x-kvmesh-cache`` value (``unreported`` without one)."""
    return header_fields(note or "").get("reason", "unreported")


def _warm(results: Sequence[RequestResult]) -> list[RequestResult]:
    return [r for r in results if r.ok and r.group is not None]


async def _router_with_workers(ctx: ChaosContext, num_workers: int) -> int:
    """Restart the fleet's router as ``--workers num_workers``; the supervisor's pid."""
    policy = ctx.fleet.router_policy
    if policy is None:
        raise FleetError("the router is not running")
    args = ctx.fleet.config.router_args
    ctx.load.pause()
    await ctx.load.wait_idle(10)
    args += ["--workers", str(num_workers)]
    try:
        await ctx.fleet.stop_router()
        await ctx.fleet.start_router(policy)
    finally:
        del args[-2:]
        ctx.load.resume()
    assert ctx.fleet.router is not None and ctx.fleet.router.pid is not None, "the router just started"
    return ctx.fleet.router.pid


async def _restart_worker(ctx: ChaosContext, supervisor: int, port: int, victim: int) -> float:
    """SIGTERM one worker and wait until its successor listens; seconds it took."""
    os.kill(victim, signal.SIGTERM)

    async def replaced() -> bool:
        live = worker_pids(supervisor)
        return (
            victim not in live
            and len(live) == NUM_ROUTER_WORKERS
            and (num_listening_sockets(port) == NUM_ROUTER_WORKERS)
        )

    took = await poll_until(replaced, WORKER_START_TIMEOUT_S, 0.1)
    if took != took:  # nan: timed out
        raise FleetError(f"router worker {victim} was not replaced in {WORKER_START_TIMEOUT_S:.0f} s")
    await asyncio.sleep(SETTLE_S)
    return took


async def rolling_restart(ctx: ChaosContext) -> ScenarioResult:
    """Restart both router workers, then every engine, one at a time, under the steady load.

    Bounds (issue-level): at most 1 % of requests for served prompts get no cached token for a reason
    the router owns (see the module docstring), no request fails, and the hit rate stays within 2
    points of the undisturbed run just before.
    """
    res = ScenarioResult("rolling_restart", "9. rolling restart of routers and engines")
    d = ctx.durations
    supervisor = await _router_with_workers(ctx, NUM_ROUTER_WORKERS)
    port = int(ctx.router_url.rsplit(":", 1)[1])
    await asyncio.sleep(d.recover_s)  # the new workers' indexes from replay, caches warm
    start = ctx.log.now()
    await asyncio.sleep(2 * d.baseline_s)
    undisturbed = ctx.load.window(start, ctx.log.now())

    worker_restart_s: list[float] = []
    engine_restart_s: list[float] = []
    disturbed_from = ctx.log.now()
    with ctx.log.fault("rolling restart: router workers"):
        for victim in worker_pids(supervisor):
            worker_restart_s.append(await _restart_worker(ctx, supervisor, port, victim))
    with ctx.log.fault("rolling restart: engines"):
        for index, engine in enumerate(ctx.fleet.engines):
            began = ctx.log.now()
            await ctx.fleet.restart_engine(index)

            async def healthy_again(pod: str = engine.url) -> bool:
                return bool((await ctx.endpoint_states())[pod]["healthy"])

            await poll_until(healthy_again, 30.0)
            engine_restart_s.append(ctx.log.now() - began)
            await asyncio.sleep(SETTLE_S)
    await asyncio.sleep(d.recover_s)
    await ctx.load.wait_idle(10)
    disturbed = ctx.load.window(disturbed_from, ctx.log.now())

    warm = _warm(disturbed)
    blind = decisions_without_cache_data(disturbed)
    blind_share = blind / len(warm) if warm else float("nan")
    gap = hit_rate(undisturbed) - hit_rate(disturbed)
    res.figures.update(
        router_workers=NUM_ROUTER_WORKERS,
        slowest_worker_restart_s=max(worker_restart_s),
        slowest_engine_restart_s=max(engine_restart_s),
        requests_undisturbed=len(undisturbed),
        requests_disturbed=len(disturbed),
        warm_requests_disturbed=len(warm),
        decisions_without_cache_data=blind,
        served_without_cache=len(served_without_cache(disturbed)),
        failures=failure_kinds(disturbed),
        reasons_without_cache=reasons_without_cache(disturbed),
        decisions_without_cache_data_undisturbed=decisions_without_cache_data(undisturbed),
        hit_rate_undisturbed=hit_rate(undisturbed),
        hit_rate_disturbed=hit_rate(disturbed),
    )
    res.check("failed requests during the rolling restart", num_failed(disturbed), "==", 0)
    res.check("share of served prompts routed without cache data", blind_share, "<=", BLIND_SHARE_BOUND)
    res.check("hit rate below the undisturbed run", gap, "<=", HIT_RATE_GAP_BOUND)
    return res
