"""Process faults under load: the shared tier dies or freezes, an engine dies, the router restarts."""

from __future__ import annotations

import asyncio
import math
import os
import random
import signal

import aiohttp
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvmesh.bench.metrics import RequestResult
from kvmesh.bench.runner import send_request
from kvmesh.chaos.bounds import ScenarioResult
from kvmesh.chaos.context import ChaosContext, poll_until
from kvmesh.chaos.load import hit_rate, num_failed, seconds_to_recover, ttft_quantile
from kvmesh.errors import FleetError
from kvmesh.workload import RequestSpec

DEAD_ENGINE_BOUND_S = 2.0
INDEX_REBUILD_BOUND_S = 5.0
REBUILT_SHARE = 0.95
"""A rebuilt index holding this share of the keys it held before the restart counts as rebuilt."""


FRESH_PROMPTS = 16
IN_FLIGHT_WINDOW_S = 5.0
"""Requests sent this long before a kill may still have been in flight when it came."""


async def _fresh_burst(ctx: ChaosContext, count: int) -> list[RequestResult]:
    """``count`` concurrent requests with prompts no engine has seen."""
    rng = random.Random(2)
    specs = [
        RequestSpec(
            request_id=f"fresh-{n}",
            arrival_s=0.0,
            prompt_token_ids=[rng.randrange(3, ctx.vocab_size) for _ in range(320)],
            output_len=8,
        )
        for n in range(count)
    ]
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(
            await asyncio.gather(*(send_request(session, s, ctx.load.options, ctx.log.t0) for s in specs))
        )


async def _num_keys(url: str) -> int | None:
    """DBSIZE of the shared server, ``None`` while it does not answer."""
    client = aioredis.Redis.from_url(url.replace("valkey://", "redis://", 1), socket_timeout=0.5)
    try:
        return int(await client.dbsize())
    except (RedisError, OSError):
        return None
    finally:
        await client.aclose()


async def shared_tier_dies(ctx: ChaosContext) -> ScenarioResult:
    """SIGSTOP the shared server (then SIGCONT), and SIGKILL it (then start it again, empty).

    Frozen goes first: a killed server refuses connections at once, a frozen one costs the engines
    a timeout per call until their breakers open, and the breaker opened by the first fault would
    hide the second for its back-off. Bound: no request fails while the tier is down or coming
    back. Figures: worst added TTFT, hit rate during each outage, seconds from restoring the
    server until the engines write to it again (its key count grows) and until p90 TTFT is back
    within 1.5x the baseline's.
    """
    res = ScenarioResult("shared_tier", "1. shared tier dies (SIGSTOP, SIGKILL)")
    server, url = ctx.fleet.store_process, ctx.fleet.store_url
    if server is None or url is None:
        raise FleetError("the fleet has no shared server (run with --shared redis or valkey)")
    d = ctx.durations
    start = ctx.log.now()
    await asyncio.sleep(d.baseline_s)
    base = ctx.load.window(start, ctx.log.now())
    base_p50 = ttft_quantile(base, 0.5)
    base_p90 = ttft_quantile(base, 0.9)
    res.figures.update(baseline_hit_rate=hit_rate(base), baseline_p90_ttft_s=base_p90)
    ttft_limit = max(1.5 * base_p90, base_p90 + 0.05)
    failed = 0
    for how in ("SIGSTOP", "SIGKILL"):
        server = ctx.fleet.store_process
        assert server is not None and server.pid is not None, "shared server vanished between faults"
        with ctx.log.fault(f"{server.name} {how}"):
            down = ctx.log.now()
            if how == "SIGKILL":
                server.stop_now()
            else:
                os.killpg(server.pid, signal.SIGSTOP)
            await asyncio.sleep(d.outage_s)
            if how == "SIGKILL":
                await ctx.fleet.restart_shared_tier()
            else:
                os.killpg(server.pid, signal.SIGCONT)
            up = ctx.log.now()
        keys_at_restore = await _num_keys(url) or 0

        async def writes_again(floor: int = keys_at_restore) -> bool:
            return (await _num_keys(url) or 0) > floor

        recover_s = await poll_until(writes_again, d.recover_s + 30.0, 0.1)
        await ctx.sleep_until(up + d.recover_s)
        end = ctx.log.now()
        await ctx.load.wait_idle(10)
        outage = ctx.load.window(down, up)
        key = how.lower()
        failed += num_failed(ctx.load.window(down, end))
        worst = max((r.ttft_s for r in outage if r.ok and r.ttft_s is not None), default=float("nan"))
        res.figures[f"{key}_worst_added_ttft_s"] = worst - base_p50
        res.figures[f"{key}_outage_p90_ttft_s"] = ttft_quantile(outage, 0.9)
        res.figures[f"{key}_outage_hit_rate"] = hit_rate(outage)
        res.figures[f"{key}_outage_requests"] = len(outage)
        res.figures[f"{key}_writes_resume_s"] = recover_s
        res.figures[f"{key}_ttft_recover_s"] = seconds_to_recover(ctx.load.results, up, end, ttft_limit)
    res.check("failed requests during tier outages", failed, "==", 0)
    return res


async def engine_dies(ctx: ChaosContext) -> ScenarioResult:
    """SIGKILL the last engine mid-load, start it again after the outage.

    Bounds: the router stops sending to it within 2 s; only requests in flight at the kill fail;
    after the restart its stale blocks are gone from the index and it serves again.
    """
    res = ScenarioResult("engine_dies", "2. an engine dies mid-load (SIGKILL)")
    d = ctx.durations
    index = len(ctx.fleet.engines) - 1
    victim = ctx.fleet.engines[index]
    pod = victim.url
    await asyncio.sleep(d.baseline_s)
    states = await ctx.endpoint_states()
    blocks_before = int(states[pod]["indexed_blocks"])
    resets_before = (await ctx.admin_get("/admin/index"))["subscriber"]["num_resets"]
    retries_before = await ctx.router_counter("kvmesh_router_retries_total")

    async def taken_out() -> bool:
        return not (await ctx.endpoint_states())[pod]["healthy"]

    with ctx.log.fault(f"{victim.process.name} SIGKILL"):
        killed = ctx.log.now()
        in_flight = ctx.load.num_in_flight
        victim.process.stop_now()
        detect_s = await poll_until(taken_out, 10.0, 0.02)
        await ctx.sleep_until(killed + d.outage_s)
        await ctx.fleet.restart_engine(index)
        restarted = ctx.log.now()

    async def back_in() -> bool:
        return bool((await ctx.endpoint_states())[pod]["healthy"])

    await poll_until(back_in, 10.0)
    blocks_after = int((await ctx.endpoint_states())[pod]["indexed_blocks"])
    # Read after the router's count: the new engine's cache only grows this early, so every block
    # the router holds for it beyond what it caches is one left from before the kill.
    cached_after = await ctx.metric_total(pod, "kvmesh:cached_blocks")
    stale = max(0, blocks_after - int(cached_after)) if math.isfinite(cached_after) else blocks_after
    # The steady load's prompts are all cached on the survivors, so prefix affinity keeps them
    # there; prompts new to every engine are placed by load and show the restarted one serving.
    fresh = await _fresh_burst(ctx, FRESH_PROMPTS)
    await asyncio.sleep(d.recover_s)
    await ctx.load.wait_idle(10)
    end = ctx.log.now()
    resets_after = (await ctx.admin_get("/admin/index"))["subscriber"]["num_resets"]
    retries = await ctx.router_counter("kvmesh_router_retries_total") - retries_before
    failed_in_flight = num_failed(ctx.load.window(killed - IN_FLIGHT_WINDOW_S, killed))
    failed_after = num_failed(ctx.load.window(killed, end)) + num_failed(fresh)
    served_after = sum(1 for r in [*ctx.load.window(restarted, end), *fresh] if r.ok and r.endpoint == pod)
    res.figures.update(
        in_flight_at_kill=in_flight,
        failed_in_flight=failed_in_flight,
        indexed_blocks_before_kill=blocks_before,
        indexed_blocks_after_restart=blocks_after,
        cached_blocks_after_restart=cached_after,
        publisher_resets=resets_after - resets_before,
        requests_retried_elsewhere=retries,
        requests_served_after_restart=served_after,
    )
    res.check("seconds until the router stops sending to it", detect_s, "<=", DEAD_ENGINE_BOUND_S, "s")
    res.check("failed requests sent after the kill", failed_after, "==", 0)
    res.check("its blocks indexed before the kill", blocks_before, ">=", 1)
    res.check("its stale blocks left in the index", stale, "==", 0)
    res.check("requests it served after restarting", served_after, ">=", 1)
    return res


async def router_restarts(ctx: ChaosContext) -> ScenarioResult:
    """Stop the router and start it again on its port; its index comes back from the engines' replay.

    Bound: the engines' cached blocks re-announced (95 % of those the router tracked) within 5 s of
    the router answering. The shared tier's blocks are reported, not bounded: what an engine that
    has since restarted announced is in no replay buffer (the shared tier still holds it; the router
    learns it again as engines write).
    Figures: hit rate before and after, index keys, shared-tier blocks.
    """
    res = ScenarioResult("router_restarts", "3. router restarts")
    d = ctx.durations
    policy = ctx.fleet.router_policy
    if policy is None:
        raise FleetError("the router is not running")
    start = ctx.log.now()
    await asyncio.sleep(d.baseline_s)
    before = ctx.load.window(start, ctx.log.now())
    with ctx.log.fault("router restart"):
        ctx.load.pause()
        await ctx.load.wait_idle(10)
        keys_before = await ctx.index_keys()
        own_before, shared_before = await ctx.announced_blocks()
        stopped = ctx.log.now()
        await ctx.fleet.stop_router()
        await ctx.fleet.start_router(policy)
        answering = ctx.log.now()

        async def rebuilt() -> bool:
            return (await ctx.announced_blocks())[0] >= REBUILT_SHARE * own_before

        rebuild_s = await poll_until(rebuilt, 3 * INDEX_REBUILD_BOUND_S)
        keys_after = await ctx.index_keys()
        own_after, shared_after = await ctx.announced_blocks()
        ctx.load.resume()
    resumed = ctx.log.now()
    await asyncio.sleep(d.recover_s)
    after = ctx.load.window(resumed, ctx.log.now())
    res.figures.update(
        index_keys_before=keys_before,
        index_keys_rebuilt=keys_after,
        engine_blocks_before=own_before,
        engine_blocks_rebuilt=own_after,
        shared_tier_blocks_before=shared_before,
        shared_tier_blocks_rebuilt=shared_after,
        router_start_s=answering - stopped,
        hit_rate_before=hit_rate(before),
        hit_rate_after=hit_rate(after),
        failed_after=num_failed(after),
    )
    res.check("seconds to rebuild the index from replay", rebuild_s, "<=", INDEX_REBUILD_BOUND_S, "s")
    res.check("failed requests after the restart", num_failed(after), "==", 0)
    return res
