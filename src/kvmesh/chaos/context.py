"""What every fleet scenario works with: the fleet, the load, the clock, and the router's admin API."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvmesh.chaos.load import SteadyLoad
from kvmesh.chaos.schedule import Durations, FaultLog
from kvmesh.errors import FleetError
from kvmesh.fleet.launcher import Fleet
from kvmesh.router.index import SHARED_TIER_HOLDER
from kvmesh.workload import RequestSpec


@dataclass(slots=True)
class ChaosContext:
    """A running fleet under load.

    Args:
        fleet: engines, router and shared tier.
        load: the steady load through the router.
        log: the run's clock and fault log.
        durations: phase lengths of this mode.
        model: the served model name.
        vocab_size: the engines' vocabulary (token ids in prompts stay below it).
        admin_token: the router's admin bearer token.
        session: a client session for admin and probe calls.
        prompts: the load's prompts.
    """

    fleet: Fleet
    load: SteadyLoad
    log: FaultLog
    durations: Durations
    model: str
    vocab_size: int
    admin_token: str
    session: aiohttp.ClientSession
    prompts: list[RequestSpec]

    @property
    def router_url(self) -> str:
        if self.fleet.router_url is None:
            raise FleetError("the router is not running")
        return self.fleet.router_url

    async def admin_get(self, path: str) -> Any:
        """``GET`` an admin route of the router with the token; the decoded JSON body.

        Raises:
            FleetError: the router did not answer 200.
        """
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        timeout = aiohttp.ClientTimeout(total=5)
        try:
            async with self.session.get(self.router_url + path, headers=headers, timeout=timeout) as resp:
                if resp.status != 200:
                    raise FleetError(f"GET {path}: HTTP {resp.status}: {(await resp.text())[:200]}")
                return await resp.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise FleetError(f"GET {path}: {exc}") from exc

    async def endpoint_states(self) -> dict[str, dict[str, Any]]:
        """Pod URL → the router's view of it (``healthy``, ``indexed_blocks``, ...)."""
        body = await self.admin_get("/admin/endpoints")
        return {e["pod"]: e for e in body["endpoints"]}

    async def index_keys(self) -> int:
        body = await self.admin_get("/admin/index")
        return int(body["index"]["num_keys"])

    async def announced_blocks(self) -> tuple[int, int]:
        """Engine blocks the router tracks: (the engines' own caches, the shared tier's)."""
        body = await self.admin_get("/admin/index")
        pods: dict[str, dict[str, Any]] = body.get("pods") or {}
        shared = int((pods.get(SHARED_TIER_HOLDER) or {}).get("blocks") or 0)
        own = sum(int(p.get("blocks") or 0) for pod, p in pods.items() if pod != SHARED_TIER_HOLDER)
        return own, shared

    async def router_counter(self, name: str) -> float:
        """A label-less sample of the router's ``/metrics`` (``nan`` when absent)."""
        async with self.session.get(self.router_url + "/metrics") as resp:
            text = await resp.text()
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return float("nan")

    async def metric_total(self, url: str, name: str) -> float:
        """The sum of ``name``'s samples over all their labels in ``url``'s ``/metrics`` (``nan``
        when absent)."""
        async with self.session.get(url + "/metrics") as resp:
            text = await resp.text()
        samples = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((name + " ", name + "{"))
        ]
        return sum(samples) if samples else float("nan")

    async def sleep_until(self, t_s: float) -> None:
        """Sleep until the run's clock reads ``t_s``."""
        delay = t_s - self.log.now()
        if delay > 0:
            await asyncio.sleep(delay)


async def poll_until(
    check: Callable[[], Awaitable[bool]], timeout_s: float, interval_s: float = 0.05
) -> float:
    """Call the async ``check`` until it returns True; seconds it took, ``nan`` on timeout.

    A check that raises :class:`FleetError` (a process not answering in time, as a busy router
    may not) counts as not yet.
    """
    start = time.perf_counter()
    while True:
        try:
            done = await check()
        except FleetError:
            done = False
        if done:
            return time.perf_counter() - start
        if time.perf_counter() - start > timeout_s:
            return float("nan")
        await asyncio.sleep(interval_s)
