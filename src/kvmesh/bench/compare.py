"""Runs of one workload against one fleet, once per router policy, caches emptied between runs.

Between two policies every engine's device-tier cache is emptied (``POST /reset_prefix_cache``, which
on kvmesh engines empties their private store tiers too, or a restart of the engines where that route
is missing), the shared tier is emptied, and the router is
started afresh with the next policy, so no run inherits another's cache state or routing history.
Where engines have no reset route and restarting them costs more than the runs (emulated fleets),
each run instead shifts its token ids (see :func:`compare_policies`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

import aiohttp

from kvmesh.bench.metrics import RunResult
from kvmesh.bench.runner import RunOptions, run_workload
from kvmesh.fleet import Fleet
from kvmesh.workload import Workload, shifted


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


async def reset_fleet(fleet: Fleet, *, allow_restart: bool = True) -> bool:
    """Stop the router and empty every cache of the fleet; the caller starts the next router.

    Engines are emptied through their cache-reset route; where an engine lacks it they are restarted
    when ``allow_restart``. The shared tier is emptied.

    Returns:
        ``True`` when the engines' caches are empty; ``False`` when they still hold the last run's
        blocks (no reset route and ``allow_restart`` is false).
    """
    await fleet.stop_router()
    await fleet.reset_shared_tier()
    emptied = await fleet.reset_engine_caches()
    if not emptied and allow_restart:
        await fleet.stop_engines()
        await fleet.start_engines()
        emptied = True
    return emptied


ResetMode = Literal["auto", "restart", "shift"]


async def compare_policies(
    fleet: Fleet,
    workload: Workload,
    policies: Sequence[str],
    options: RunOptions,
    *,
    reset: ResetMode = "auto",
    scheduler_configs: Mapping[str, str] | None = None,
) -> dict[str, RunResult]:
    """One run per policy on ``fleet``; returns the runs keyed by policy, in the order given.

    Args:
        reset: how runs are kept from hitting each other's caches. ``restart``: empty every cache
            (reset route, else engine restart). ``shift``: the router restarts and the shared tier is
            emptied, but engine caches are emptied only through their reset route; where that is
            missing, run ``k`` shifts every token id by ``k`` (same lengths, order and arrival times,
            no block in common with another run), so blocks left from earlier runs can never hit and
            are evicted first. ``auto``: ``shift`` for a fleet of emulated engines (restarts cost more
            than the runs), ``restart`` otherwise.
        scheduler_configs: per policy, a scheduler YAML replacing the router preset's weights.
    """
    scheduler_configs = scheduler_configs or {}
    mode = reset if reset != "auto" else ("shift" if fleet.config.emulate else "restart")
    runs: dict[str, RunResult] = {}
    for k, policy in enumerate(policies):
        run_workload_k = workload
        if k > 0:
            emptied = await reset_fleet(fleet, allow_restart=mode == "restart")
            if not emptied:
                run_workload_k = shifted(workload, k * 7919)
        if fleet.router is None or fleet.router_policy != policy or policy in scheduler_configs:
            await fleet.start_router(policy, scheduler_configs.get(policy))
        # The fleet's engines are sampled by run_on_fleet: no metrics URL carries over.
        opts = dataclasses.replace(
            options, base_url=fleet.url, metrics_urls=[], headers=dict(options.headers), label=policy
        )
        runs[policy] = await run_on_fleet(fleet, run_workload_k, opts)
        fleet.check_alive()
    return runs
