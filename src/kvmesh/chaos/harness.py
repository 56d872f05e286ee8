"""Runs the scenarios in order on one fleet under one steady load, and builds the report.

::

    start fleet (2 CPU engines of a tiny model, router with an admin token, redis/valkey shared tier)
    start steady load ──────────────────────────────────────────────────────────────► stop
        1 shared tier dies   2 engine dies   3 router restarts   6 tenants   5 HTTP/event fuzz   7 soak
    4 corruption (store level, its own tiers; the Redis tier on the fleet's server), then corrupt
      chunks in the fleet's server under the engines (4b)
    8 overload burst (its own emulated fleet, behind a router with flow control; the load paused)
    9 rolling restart: the router as two workers, each restarted in turn, then every engine

A scenario that raises is recorded as failed with its error, and the run goes on with the next.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import secrets
import shlex
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import aiohttp

from kvmesh.chaos.bounds import ScenarioResult
from kvmesh.chaos.context import ChaosContext
from kvmesh.chaos.corruption import corruption
from kvmesh.chaos.corruption_e2e import shared_tier_corruption
from kvmesh.chaos.fleet_faults import engine_dies, router_restarts, shared_tier_dies
from kvmesh.chaos.fuzz_events import fuzz_event_frames
from kvmesh.chaos.fuzz_http import malformed_http
from kvmesh.chaos.load import SteadyLoad, chaos_prompts, num_failed, series
from kvmesh.chaos.overload import overload_burst
from kvmesh.chaos.report import ChaosReport
from kvmesh.chaos.rolling_restart import rolling_restart
from kvmesh.chaos.schedule import FULL, QUICK, FaultLog
from kvmesh.chaos.soak import ROUTER_CONNECTIONS_PER_ENGINE, soak
from kvmesh.chaos.tenants import tenants_stay_apart
from kvmesh.fleet import Fleet, FleetConfig

SCENARIOS = (
    "shared_tier",
    "engine_dies",
    "router_restarts",
    "tenants",
    "fuzz_events",
    "fuzz_http",
    "corruption",
    "corruption_e2e",
    "overload",
    "soak",
    "rolling_restart",
)
MODEL = "tiny-random-llama"
"""A small random-weight Llama run for real on the CPU: these save and load real KV through the
shared tier, so its faults land on the request path and in the output (emulated engines store
placeholder KV, and a fleet gives them its shared tier only with ``emulated_store``)."""


@dataclass(slots=True)
class ChaosConfig:
    """One run.

    Args:
        quick: the short bounds-only run (about 4 minutes) instead of the full one.
        shared: the shared tier's server.
        out_dir: where the report, the timeline and the fleet's logs go.
        scenarios: which to run, in :data:`SCENARIOS` order.
        rate: requests per second of the steady load (the soak sets its own).
    """

    quick: bool = True
    shared: Literal["redis", "valkey"] = "redis"
    out_dir: Path = Path("chaos-report")
    scenarios: tuple[str, ...] = SCENARIOS
    num_engines: int = 2
    rate: float = 12.0
    command: str = field(default_factory=lambda: shlex.join(["kvmesh", *sys.argv[1:]]))

    def __post_init__(self) -> None:
        unknown = sorted(set(self.scenarios) - set(SCENARIOS))
        if unknown:
            raise ValueError(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
        if self.num_engines < 2:
            raise ValueError(
                f"an engine must die while another serves: num_engines >= 2, got {self.num_engines}"
            )


def _vocab_size() -> int:
    """Vocabulary size of the engines' model."""
    from kvmesh.core.models import resolve_model

    cfg = json.loads((resolve_model(MODEL).path / "config.json").read_text())
    return int(cfg["vocab_size"])


async def _served_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models") as resp:
        return str((await resp.json())["data"][0]["id"])


async def _run_one(
    name: str,
    title: str,
    run: Callable[[], Awaitable[ScenarioResult]],
    on_done: Callable[[ScenarioResult], None],
) -> ScenarioResult:
    start = time.perf_counter()
    try:
        result = await run()
    except Exception as exc:  # a scenario's failure is a result; the next scenario still runs
        result = ScenarioResult(name, title, error=f"{type(exc).__name__}: {exc}")
    result.duration_s = time.perf_counter() - start
    on_done(result)
    return result


async def run_chaos(
    config: ChaosConfig, on_done: Callable[[ScenarioResult], None] = lambda r: None
) -> ChaosReport:
    """Start the fleet, run the chosen scenarios under load, stop everything; the report.

    Raises:
        FleetError: the fleet did not start.
    """
    durations = QUICK if config.quick else FULL
    vocab = _vocab_size()
    token = secrets.token_hex(16)
    fleet_config = FleetConfig(
        num_engines=config.num_engines,
        model=MODEL,
        shared=config.shared,
        engine_args=["--events-replay", "tcp://127.0.0.1:0"],
        router_args=[
            "--admin-token",
            token,
            "--max-connections-per-endpoint",
            str(ROUTER_CONNECTIONS_PER_ENGINE),
        ],
        run_dir=config.out_dir / "fleet",
        stop_grace_s=5.0,
    )
    report = ChaosReport(
        mode="quick" if config.quick else "full",
        command=config.command,
        started_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        fleet={"engines": config.num_engines, "model": MODEL, "device": "cpu", "shared": config.shared},
    )
    log = FaultLog()
    prompts = chaos_prompts(vocab)
    async with (
        Fleet(fleet_config) as fleet,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
    ):
        assert fleet.router_url is not None, "the fleet starts its router"
        model = await _served_model(session, fleet.router_url)
        load = SteadyLoad(fleet.router_url, model, log, prompts, rate=config.rate, vocab_size=vocab)
        ctx = ChaosContext(fleet, load, log, durations, model, vocab, token, session, prompts)
        steps: dict[str, tuple[str, Callable[[], Awaitable[ScenarioResult]]]] = {
            "shared_tier": ("1. shared tier dies", lambda: shared_tier_dies(ctx)),
            "engine_dies": ("2. an engine dies", lambda: engine_dies(ctx)),
            "router_restarts": ("3. router restarts", lambda: router_restarts(ctx)),
            "tenants": ("6. tenants", lambda: tenants_stay_apart(ctx)),
            "fuzz_events": ("5a. fuzzed event frames", lambda: fuzz_event_frames(ctx)),
            "fuzz_http": ("5b. malformed HTTP", lambda: malformed_http(ctx)),
            "corruption": ("4. corruption", lambda: corruption(durations.corrupt_chunks, fleet.store_url)),
            "corruption_e2e": ("4b. corruption under the engines", lambda: shared_tier_corruption(ctx)),
            "overload": ("8. overload burst", lambda: overload_burst(ctx)),
            "soak": ("7. soak", lambda: soak(ctx)),
            "rolling_restart": ("9. rolling restart", lambda: rolling_restart(ctx)),
        }
        load.start()
        try:
            for name in SCENARIOS:
                if name in config.scenarios:
                    title, run = steps[name]
                    report.scenarios.append(await _run_one(name, title, run, on_done))
        finally:
            await load.aclose()
        report.duration_s = log.now()
        report.faults = list(log.spans)
        report.series = series(load.results, report.duration_s)
        report.load = {
            "requests": len(load.results),
            "failed": num_failed(load.results),
            "skipped_over_in_flight_cap": load.num_skipped,
            "base_rate_rps": config.rate,
        }
    return report


def run(config: ChaosConfig, on_done: Callable[[ScenarioResult], None] = lambda r: None) -> ChaosReport:
    """:func:`run_chaos` on a fresh event loop."""
    return asyncio.run(run_chaos(config, on_done))
