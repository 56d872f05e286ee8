"""Runs of one workload against one fleet, once per router policy, caches emptied between runs.

Between two policies every engine's device-tier cache is emptied (``POST /reset_prefix_cache``, or a
restart of the engines where that route is missing), the shared tier is emptied, and the router is
started afresh with the next policy, so no run inherits another's cache state or routing history.
"""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp

from kvmesh.bench.runner import RunOptions, RunResult, run_workload
from kvmesh.bench.workloads import Workload
from kvmesh.fleet.launcher import Fleet


async def served_model(base_url: str) -> str | None:
    """The first model id that ``GET /v1/models`` lists, or ``None``."""
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(base_url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp,
        ):
            if resp.status != 200:
                return None
            data = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    models = data.get("data") if isinstance(data, dict) else None
    if isinstance(models, list) and models and isinstance(models[0], dict):
        model_id = models[0].get("id")
        return str(model_id) if model_id else None
    return None


async def run_on_fleet(fleet: Fleet, workload: Workload, options: RunOptions) -> RunResult:
    """Run ``workload`` through the fleet's router, sampling every engine's queue."""
    options.base_url = fleet.url
    options.metrics_urls = fleet.engine_urls
    if not options.model:
        options.model = await served_model(fleet.url) or "default"
    return await run_workload(workload, options)


async def reset_fleet(fleet: Fleet) -> None:
    """Empty every cache of the fleet and restart the router (fresh index and routing history).

    Engines are emptied through their cache-reset route when they all have it, and restarted
    otherwise; the shared tier is emptied.
    """
    policy = fleet.router_policy
    await fleet.stop_router()
    await fleet.reset_shared_tier()
    if not await fleet.reset_engine_caches():
        await fleet.stop_engines()
        await fleet.start_engines()
    if policy is not None:
        await fleet.start_router(policy)


async def compare_policies(
    fleet: Fleet, workload: Workload, policies: Sequence[str], options: RunOptions
) -> dict[str, RunResult]:
    """One run per policy on ``fleet``; returns the runs keyed by policy, in the order given.

    The first run uses the fleet as started when its router already has that policy and no run has
    touched it; every other run starts from a reset fleet.
    """
    runs: dict[str, RunResult] = {}
    fresh = True
    for policy in policies:
        if not fresh:
            await reset_fleet(fleet)
        if fleet.router_policy != policy:
            await fleet.start_router(policy)
        fresh = False
        opts = RunOptions(
            base_url=fleet.url,
            model=options.model,
            api=options.api,
            concurrency=options.concurrency,
            sample_interval_s=options.sample_interval_s,
            stream=options.stream,
            ignore_eos=options.ignore_eos,
            request_timeout_s=options.request_timeout_s,
            headers=dict(options.headers),
            progress=options.progress,
            label=policy,
        )
        runs[policy] = await run_on_fleet(fleet, workload, opts)
        fleet.check_alive()
    return runs
