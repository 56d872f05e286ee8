"""The router's connections to its engines stay within ``upstream.maxConnectionsPerEndpoint``.

Counted from the OS: the test process holds the gateway, so its TCP sockets connected to an
engine's port are the router's connections to that engine (requests and health checks together).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from router_fakes import MODEL, FakeEngine
from test_router_gateway import gateway_client, wait_for

from kvmesh.chaos.procs import fd_kinds
from kvmesh.errors import ConfigError
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.endpoints import PROBE_CONNECTIONS_PER_ENDPOINT

BOUND = 4
CONCURRENT = 40
"""Requests in flight at once: five times what the two engines' bounds let through."""
ROUNDS = 3


def router_connections(engines: list[FakeEngine]) -> list[int]:
    kinds = fd_kinds(os.getpid())
    assert kinds is not None, "this process's /proc entries cannot be read"
    return [kinds[f"tcp out :{e.url.rsplit(':', 1)[1]}"] for e in engines]


async def stream(client: TestClient[Any, Any], i: int) -> int:
    body = {"model": MODEL, "prompt": [5000 + i] * 32, "max_tokens": 3, "stream": True}
    async with client.post("/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status


async def test_connections_to_each_engine_stay_within_the_bound_round_after_round(engines):
    es = await engines(2)
    gate = asyncio.Event()
    for e in es:
        e.gate = gate
    async with gateway_client(es, policy="round-robin", upstream={"maxConnectionsPerEndpoint": BOUND}) as (
        gw,
        client,
    ):
        assert gw.pool is not None
        limit = BOUND + PROBE_CONNECTIONS_PER_ENDPOINT
        for _ in range(ROUNDS):
            gate.clear()
            received = sum(len(e.received) for e in es)
            checks = [e.num_health_checks for e in es]
            tasks = [asyncio.create_task(stream(client, i)) for i in range(CONCURRENT)]
            try:
                # Every connection the bound allows is held open mid-stream; the other requests
                # wait in the router, and health checks still get through on their own connections.
                await wait_for(lambda r=received: sum(len(e.received) for e in es) - r >= 2 * BOUND)
                await wait_for(
                    lambda c=checks: all(e.num_health_checks >= n + 3 for e, n in zip(es, c, strict=True))
                )
                assert max(router_connections(es)) <= limit
                assert sum(len(e.received) for e in es) - received == 2 * BOUND
                assert all(s.healthy for s in gw.pool.states())
                page = await (await client.get("/metrics")).text()
                for e in es:
                    assert (
                        f'kvmesh_router_upstream_connections{{endpoint="{e.url}",state="busy"}} {BOUND}.0'
                        in page
                    )
                    waiting = f'kvmesh_router_upstream_waiting_requests{{endpoint="{e.url}"}} '
                    assert float(page.split(waiting)[1].split()[0]) > 0
            finally:
                gate.set()
            assert await asyncio.gather(*tasks) == [200] * CONCURRENT
            assert sum(len(e.received) for e in es) - received == CONCURRENT
            assert max(router_connections(es)) <= limit


@pytest.mark.parametrize("bad", [{"maxConnectionsPerEndpoint": 0}, {"keepaliveS": 0}])
def test_the_bound_is_validated(bad):
    with pytest.raises(ConfigError, match="upstream"):
        router_config_from_dict({"upstream": bad})


def test_the_bound_defaults_to_1024_and_is_configurable():
    assert router_config_from_dict({}).upstream.max_connections_per_endpoint == 1024
    cfg = router_config_from_dict({"upstream": {"maxConnectionsPerEndpoint": 8, "keepaliveS": 5}})
    assert (cfg.upstream.max_connections_per_endpoint, cfg.upstream.keepalive_s) == (8, 5.0)
