"""Router pools: two served models behind one gateway, each with its own endpoints.

Checked: each model's requests reach only its pool's engines, an adapter an endpoint lists goes
to that endpoint's pool, an unknown model is a 404 naming the served ones, ``/v1/models`` lists
every pool's model and adapters, every metric sample carries a ``pool`` label, each pool's own
routes answer under ``/pools/<name>``, and the config rejects ambiguous pools.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from front_testing import served
from router_fakes import FakeEngine

from kvmesh.errors import ConfigError
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.endpoints import normalize_url
from kvmesh.router.gateway import ENDPOINT_HEADER
from kvmesh.router.pools import PooledRouter, pool_router_config

pytestmark = pytest.mark.usefixtures("both_servers")

HEALTH = {"intervalS": 0.1, "timeoutS": 1.0, "failureThreshold": 3, "metricsIntervalS": 0.1}


async def until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def two_pools(a: list[str], b: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "health": HEALTH,
        "flowControl": {"enabled": False},
        "pools": [
            {
                "name": "small",
                "model": "small-model",
                "aliases": ["small-alias"],
                "endpoints": [{"url": u} for u in a],
            },
            {"name": "big", "model": "big-model", "blockSize": 32, "endpoints": [{"url": u} for u in b]},
        ],
        **extra,
    }


async def start(raw: dict[str, Any]) -> tuple[PooledRouter, TestClient]:
    router = PooledRouter(router_config_from_dict(raw), tokenizers={})
    client = TestClient(served(router))
    await client.start_server()
    await until(
        lambda: all(
            sum(e.state.healthy for e in p.gateway.endpoints()) == len(p.config.endpoints)
            for p in router.pools
        )
    )
    return router, client


def test_pools_config_is_checked():
    with pytest.raises(ConfigError, match="belong to each pool"):
        router_config_from_dict(
            {"endpoints": [{"url": "http://127.0.0.1:1"}], **two_pools(["http://a:1"], ["http://b:1"])}
        )
    with pytest.raises(ConfigError, match="served by pools"):
        router_config_from_dict({"pools": [
            {"name": "x", "model": "m", "endpoints": [{"url": "http://a:1"}]},
            {"name": "y", "model": "n", "aliases": ["m"], "endpoints": [{"url": "http://b:1"}]},
        ]})  # fmt: skip
    with pytest.raises(ConfigError, match="needs endpoints or discovery"):
        router_config_from_dict({"pools": [{"name": "x", "model": "m"}]})
    config = router_config_from_dict({**two_pools(["http://a:1"], ["http://b:1"]), "blockSize": 16})
    small, big = (pool_router_config(config, p) for p in config.pools)
    assert (small.model, small.block_size, small.index.key_prefix) == ("small-model", 16, "kvmesh:idx:small:")
    assert (big.model, big.block_size, big.index.key_prefix) == ("big-model", 32, "kvmesh:idx:big:")
    assert [e.url for e in big.endpoints] == ["http://b:1"] and big.pools == []


async def test_each_models_requests_reach_only_its_pool(engines):
    a1, a2, b1 = await engines(3)
    _router, client = await start(two_pools([a1.url, a2.url], [b1.url]))
    try:
        small_pods = {normalize_url(a1.url), normalize_url(a2.url)}
        for i in range(6):
            for model in ("small-model", "small-alias"):
                resp = await client.post("/v1/completions", json={"model": model, "prompt": [i, 1, 2, 3]})
                assert resp.status == 200, await resp.text()
                assert resp.headers[ENDPOINT_HEADER] in small_pods
            resp = await client.post(
                "/v1/chat/completions",
                json={"model": "big-model", "messages": [{"role": "user", "content": "x"}]},
            )
            assert resp.status == 200, await resp.text()
            assert resp.headers[ENDPOINT_HEADER] == normalize_url(b1.url)
        assert len(a1.received) + len(a2.received) == 12
        assert {b["model"] for b in a1.received + a2.received} == {"small-model", "small-alias"}
        assert len(b1.received) == 6 and {b["model"] for b in b1.received} == {"big-model"}

        resp = await client.post("/v1/completions", json={"model": "nope", "prompt": [1]})
        body = await resp.json()
        assert resp.status == 404
        assert "`nope`" in body["error"]["message"]
        assert "small-model, small-alias, big-model" in body["error"]["message"]
        resp = await client.post(
            "/v1/messages", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
        )
        body = await resp.json()
        assert resp.status == 404 and body["type"] == "error" and "big-model" in body["error"]["message"]
        resp = await client.post("/v1/completions", json={"prompt": [1]})
        assert resp.status == 400 and "'model' is required" in (await resp.json())["error"]["message"]
        resp = await client.post("/v1/completions", data=b"{not json")
        assert resp.status == 400
        assert len(b1.received) == 6 and len(a1.received) + len(a2.received) == 12
    finally:
        await client.close()


async def test_models_metrics_and_per_pool_routes(engines):
    a1, b1 = await engines(2)
    _router, client = await start(two_pools([a1.url], [b1.url]))
    try:
        for model in ("small-model", "big-model", "big-model"):
            resp = await client.post("/v1/completions", json={"model": model, "prompt": [7, 8, 9]})
            assert resp.status == 200
        models = await (await client.get("/v1/models")).json()
        ids = [m["id"] for m in models["data"]]
        assert ids[:2] == ["small-model", "big-model"]

        text = await (await client.get("/metrics")).text()
        decisions = {}
        for line in text.splitlines():
            if line.startswith("kvmesh_router_decisions_total{"):
                labels, value = line.rsplit(" ", 1)
                decisions[labels] = float(value)
        assert decisions == {
            f'kvmesh_router_decisions_total{{endpoint="{normalize_url(a1.url)}",pool="small"}}': 1.0,
            f'kvmesh_router_decisions_total{{endpoint="{normalize_url(b1.url)}",pool="big"}}': 2.0,
        }
        samples = [line for line in text.splitlines() if line and not line.startswith("#")]
        assert samples and all('pool="' in line for line in samples)
        assert text.count("# TYPE kvmesh_router_decisions_total counter") <= 1

        health = await client.get("/health")
        assert health.status == 200
        assert (await health.json())["pools"] == {
            "small": {"endpoints": 1, "healthy": 1},
            "big": {"endpoints": 1, "healthy": 1},
        }
        own = await client.get("/pools/big/health")
        assert own.status == 200 and (await own.json())["endpoints"] == 1
        own_metrics = await (await client.get("/pools/big/metrics")).text()
        assert 'pool="' not in own_metrics and "kvmesh_router_decisions_total" in own_metrics
    finally:
        await client.close()


LORA_METRICS = (
    "# TYPE vllm:lora_requests_info gauge\n"
    'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7e+09\n'
)


async def test_an_adapter_goes_to_the_pool_whose_endpoints_list_it(engines):
    (plain,) = await engines(1)
    lora = FakeEngine("lora")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=LORA_METRICS)

    async def models(request: web.Request) -> web.Response:
        data = [{"id": "big-model", "object": "model", "parent": None},
                {"id": "sql-adapter", "object": "model", "parent": "big-model"}]  # fmt: skip
        return web.json_response({"object": "list", "data": data})

    lora._metrics = metrics  # type: ignore[method-assign]
    lora._models = models  # type: ignore[method-assign]
    await lora.start()
    router, client = await start(two_pools([plain.url], [lora.url]))
    try:
        big = router.pools[1]
        await until(lambda: "sql-adapter" in big.adapters())
        assert router.pool_for("sql-adapter") is big and router.pools[0].adapters() == frozenset()
        resp = await client.post("/v1/completions", json={"model": "sql-adapter", "prompt": [1, 2, 3]})
        assert resp.status == 200 and resp.headers[ENDPOINT_HEADER] == normalize_url(lora.url)
        assert lora.received[-1]["model"] == "sql-adapter" and plain.received == []
        ids = [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]]
        assert ids == ["small-model", "big-model", "sql-adapter"]
    finally:
        await client.close()
        await lora.stop()


async def test_a_pools_prefixed_route_reaches_the_engines_own_route(engines):
    a1, b1 = await engines(2)
    _router, client = await start(two_pools([a1.url], [b1.url]))
    try:
        resp = await client.post(
            "/pools/small/v1/completions", json={"model": "small-model", "prompt": [1, 2]}
        )
        assert resp.status == 200, await resp.text()
        assert resp.headers[ENDPOINT_HEADER] == normalize_url(a1.url) and len(a1.received) == 1
        resp = await client.post(
            "/pools/big/v1/chat/completions",
            json={"model": "big-model", "messages": [{"role": "user", "content": "x"}]},
        )
        assert resp.status == 200, await resp.text()
        assert len(b1.received) == 1
    finally:
        await client.close()
