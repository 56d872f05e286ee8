"""Two real engines sharing a store directory behind the router: what one engine wrote to the shared
tier, the router credits to the other, and that engine does load it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvmesh.engine.app import EngineOptions, build_engine
from kvmesh.engine.server import EngineServer
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.endpoints import normalize_url
from kvmesh.router.gateway import ENDPOINT_HEADER, Gateway
from kvmesh.router.types import EndpointState, PrefixMatch, RoutingRequest

pytestmark = pytest.mark.slow

PROMPT = [(i * 7) % 200 + 3 for i in range(600)]  # two full 256-token store chunks and a partial one


async def until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_the_router_credits_every_engine_with_the_shared_tier_and_the_engine_loads_it(tmp_path: Path):
    engines: list[EngineServer] = []
    for _ in range(2):
        opts = EngineOptions(
            model="tiny-random-llama",
            store=f"file://{tmp_path / 'shared'}",
            events="tcp://127.0.0.1:0",
            events_replay="tcp://127.0.0.1:0",
        )
        server = await build_engine(opts)
        await server.start("127.0.0.1", 0)
        engines.append(server)
    raw = {
        "endpoints": [{"url": e.url} for e in engines],
        "policy": "precise",
        "adminToken": "s3cret",
        "health": {"intervalS": 0.25, "timeoutS": 2.0, "failureThreshold": 3, "metricsIntervalS": 0.5},
    }
    gw = Gateway(router_config_from_dict(raw))
    client = TestClient(TestServer(gw.app))
    await client.start_server()
    try:
        await until(lambda: gw.pool is not None and sum(s.healthy for s in gw.pool.states()) == 2)
        assert gw.pool is not None
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        writer = resp.headers[ENDPOINT_HEADER]
        assert gw.applier is not None
        probe = RoutingRequest("probe", PROMPT + [9] * 40, gw.applier.namespace())

        def matched() -> PrefixMatch:
            return gw.scheduler.match(probe)

        await until(lambda: (m := matched()).shared is not None and m.shared.num_blocks == 32)
        pods = [s.pod for s in gw.pool.states()]
        other_pod = next(p for p in pods if p != writer)
        other = next(e for e in engines if normalize_url(e.url) == other_pod)
        match = matched()
        assert match.hit_tokens(other_pod) == 512, "credited with the shared tier's two chunks"
        # with the writer busy, the scheduler sends the prompt where it loads the prefix
        probe.prefix = match
        states = [EndpointState(p, pending_prefill_tokens=50_000 if p == writer else 0) for p in pods]
        assert gw.scheduler.rank(probe, states)[0] == other_pod
        # and the credit is real: the other engine loads those 512 tokens from the shared tier
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{other.url}/v1/completions", json={**body, "prompt": probe.tokens}) as direct,
        ):
            usage = (await direct.json())["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 512
        # the operator empties the store: the router forgets the shared tier's credit, not the
        # engines' own blocks
        auth = {"Authorization": "Bearer s3cret"}
        own = matched().pods[writer].num_blocks
        resp = await client.post("/admin/flush", json={"shared": True}, headers=auth)
        assert resp.status == 200 and (await resp.json())["flushed"] >= 32
        after = matched()
        assert after.shared is None and after.pods[writer].num_blocks == own
        assert after.hit_tokens(other_pod) == 0 or other_pod in after.pods
        bad = await client.post("/admin/flush", json={"shared": "yes"}, headers=auth)
        assert bad.status == 400
    finally:
        await client.close()
        for e in engines:
            await e.stop()
