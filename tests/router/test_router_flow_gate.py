"""Flow control in the live gateway, in front of real local test engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient, TestServer
from router_fakes import MODEL, FakeEngine

from kvmesh.core.tenancy import TENANT_HEADER
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.flow_gate import MAX_QUEUE_WAIT_HEADER, PRIORITY_HEADER, QUEUE_WAIT_HEADER
from kvmesh.router.gateway import Gateway

# one in flight per endpoint saturates it (a profile without a TTFT estimate: the load test applies)
ONE_AT_A_TIME = {"maxInFlightPerEndpoint": 1, "maxQueueWaitSeconds": 10}


@contextlib.asynccontextmanager
async def gateway(
    engines: list[FakeEngine], flow: dict[str, Any] | None, policy: str = "load", **overrides: Any
):
    raw: dict[str, Any] = {
        "endpoints": [{"url": e.url} for e in engines],
        "policy": policy,
        "seed": 1,
        "health": {"intervalS": 0.2, "timeoutS": 0.5, "failureThreshold": 2, "metricsIntervalS": 0.2},
    }
    if flow is not None:
        raw["flowControl"] = flow
    raw.update(overrides)
    gw = Gateway(router_config_from_dict(raw))
    client = TestClient(TestServer(gw.app))
    await client.start_server()
    try:
        yield gw, client
    finally:
        await client.close()


def prompt(i: int) -> list[int]:
    return list(range(10_000 + 1000 * i, 10_000 + 1000 * i + 160))


async def post(client: TestClient, i: int, headers: dict[str, str] | None = None, stream: bool = True):
    resp = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt(i), "max_tokens": 3, "stream": stream},
        headers=headers,
    )
    body = await resp.read()
    return resp, body


async def wait_for(cond, timeout: float = 5.0) -> None:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def queued(gw: Gateway) -> int:
    assert gw.flow_gate is not None
    return len(gw.flow_gate.controller)


def sent_prompts(engine: FakeEngine) -> list[int]:
    """Which ``prompt(i)`` each request the engine received was, in arrival order."""
    return [(body["prompt"][0] - 10_000) // 1000 for body in engine.received]


async def test_saturated_requests_wait_for_a_first_token_then_go(engines):
    (e,) = await engines(1)
    e.prefill_gate = asyncio.Event()
    # each 160-token prompt is 0.02 s at the prior 8000 tokens/s, and the cached tokens the new one
    # would evict add half its own (the default's evictWeight 0.5): the second is predicted at
    # 0.02 + 0.01 + 0.02 = 0.05 s, the third at 0.04 + 0.01 + 0.02 = 0.07 s
    flow = {"maxPredictedTtftSeconds": 0.06, "requireLearnedSpeed": False}
    async with gateway([e], flow, policy="precise") as (gw, client):
        first = [asyncio.ensure_future(post(client, i)) for i in range(2)]
        await wait_for(lambda: len(e.received) == 2)
        third = asyncio.ensure_future(post(client, 2))
        await wait_for(lambda: queued(gw) == 1)
        await asyncio.sleep(0.1)
        assert len(e.received) == 2 and not third.done()
        e.prefill_gate.set()  # first tokens: the predicted TTFT drops and the third one goes
        resp, _ = await third
        assert resp.status == 200 and int(resp.headers[QUEUE_WAIT_HEADER]) >= 100
        for f in first:
            resp, _ = await f
            assert resp.status == 200 and resp.headers[QUEUE_WAIT_HEADER] == "0"
        assert sent_prompts(e) == [0, 1, 2]


async def test_a_flooding_tenant_cannot_starve_another(engines):
    (e,) = await engines(1)
    e.gate = asyncio.Event()
    async with gateway([e], ONE_AT_A_TIME) as (gw, client):
        a = [asyncio.ensure_future(post(client, i, {TENANT_HEADER: "A"})) for i in range(30)]
        await wait_for(lambda: len(e.received) == 1 and queued(gw) == 29)
        b = [asyncio.ensure_future(post(client, 100 + i, {TENANT_HEADER: "B"})) for i in range(5)]
        await wait_for(lambda: queued(gw) == 34)
        e.gate.set()
        results = await asyncio.gather(*a, *b)
        assert all(resp.status == 200 for resp, _ in results)
        order = ["B" if i >= 100 else "A" for i in sent_prompts(e)]
        # A's first request was in flight when B arrived; then the two take turns
        assert order[:12] == ["A", "A", "B", "A", "B", "A", "B", "A", "B", "A", "B", "A"]
        assert order[12:] == ["A"] * 23


async def test_higher_priority_goes_first(engines):
    (e,) = await engines(1)
    e.gate = asyncio.Event()
    async with gateway([e], ONE_AT_A_TIME) as (gw, client):
        head = asyncio.ensure_future(post(client, 0))
        await wait_for(lambda: len(e.received) == 1)
        low = [asyncio.ensure_future(post(client, 1 + i, {PRIORITY_HEADER: "-1"})) for i in range(3)]
        await wait_for(lambda: queued(gw) == 3)
        mid = asyncio.ensure_future(post(client, 10))
        high = asyncio.ensure_future(post(client, 20, {PRIORITY_HEADER: "7"}))
        await wait_for(lambda: queued(gw) == 5)
        e.gate.set()
        await asyncio.gather(head, *low, mid, high)
        assert sent_prompts(e) == [0, 20, 10, 1, 2, 3]


async def test_past_the_deadline_a_request_gets_429_with_retry_after(engines):
    (e,) = await engines(1)
    e.gate = asyncio.Event()
    async with gateway([e], {**ONE_AT_A_TIME, "maxQueueWaitSeconds": 0.3}) as (_, client):
        head = asyncio.ensure_future(post(client, 0))
        await wait_for(lambda: len(e.received) == 1)
        started = time.monotonic()
        resp, body = await post(client, 1, stream=False)
        waited = time.monotonic() - started
        assert resp.status == 429 and 0.3 <= waited < 2.0
        assert int(resp.headers["Retry-After"]) >= 1
        assert int(resp.headers[QUEUE_WAIT_HEADER]) >= 300
        error = json.loads(body)["error"]
        assert error["code"] == 429 and error["type"] == "overloaded"
        assert "saturated" in error["message"] and "retry after" in error["message"]
        # a request may ask for a shorter wait than the router's, not a longer one
        started = time.monotonic()
        resp, _ = await post(client, 2, {MAX_QUEUE_WAIT_HEADER: "50"})
        assert resp.status == 429 and time.monotonic() - started < 0.25
        resp, _ = await post(client, 3, {MAX_QUEUE_WAIT_HEADER: "0"})
        assert resp.status == 429 and resp.headers[QUEUE_WAIT_HEADER] == "0"
        e.gate.set()
        resp, _ = await head
        assert resp.status == 200
        assert sent_prompts(e) == [0]  # the shed requests never reached the engine
        metrics = await (await client.get("/metrics")).text()
        assert 'kvmesh_router_flow_shed_total{reason="deadline"} 3.0' in metrics
        assert 'kvmesh_router_flow_queue_wait_seconds_count{outcome="shed"} 2.0' in metrics


async def test_queue_bounds_answer_429_at_once(engines):
    (e,) = await engines(1)
    e.gate = asyncio.Event()
    flow = {**ONE_AT_A_TIME, "maxQueuedRequests": 3, "perTenantMaxQueued": 2}
    async with gateway([e], flow) as (gw, client):
        head = asyncio.ensure_future(post(client, 0))
        await wait_for(lambda: len(e.received) == 1)
        waiting = [asyncio.ensure_future(post(client, 1 + i, {TENANT_HEADER: "A"})) for i in range(2)]
        await wait_for(lambda: queued(gw) == 2)
        resp, body = await post(client, 5, {TENANT_HEADER: "A"})
        assert resp.status == 429 and json.loads(body)["error"]["type"] == "rate_limit_exceeded"
        waiting.append(asyncio.ensure_future(post(client, 6, {TENANT_HEADER: "B"})))
        await wait_for(lambda: queued(gw) == 3)
        resp, body = await post(client, 7, {TENANT_HEADER: "C"})
        assert resp.status == 429 and json.loads(body)["error"]["type"] == "overloaded"
        assert "Retry-After" in resp.headers
        e.gate.set()
        assert [r.status for r, _ in await asyncio.gather(head, *waiting)] == [200] * 4
        metrics = await (await client.get("/metrics")).text()
        assert 'kvmesh_router_flow_shed_total{reason="tenant_queue_full"} 1.0' in metrics
        assert 'kvmesh_router_flow_shed_total{reason="queue_full"} 1.0' in metrics
        assert "kvmesh_router_flow_queued_total 3.0" in metrics


async def test_a_client_that_goes_away_leaves_the_queue(engines):
    (e,) = await engines(1)
    e.gate = asyncio.Event()
    async with gateway([e], ONE_AT_A_TIME) as (gw, client):
        head = asyncio.ensure_future(post(client, 0))
        await wait_for(lambda: len(e.received) == 1)
        url = str(client.make_url("/v1/completions"))
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": prompt(1), "max_tokens": 3}
            gone = asyncio.ensure_future(session.post(url, json=body))
            await wait_for(lambda: queued(gw) == 1)
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
        await wait_for(lambda: queued(gw) == 0, timeout=2.0)
        e.gate.set()
        await head
        await asyncio.sleep(0.1)
        assert sent_prompts(e) == [0]
        metrics = await (await client.get("/metrics")).text()
        assert 'kvmesh_router_flow_queue_wait_seconds_count{outcome="cancelled"} 1.0' in metrics


async def test_queue_depth_is_exported_per_tenant_and_priority(engines):
    (e,) = await engines(1)
    e.gate = asyncio.Event()
    async with gateway([e], ONE_AT_A_TIME) as (gw, client):
        head = asyncio.ensure_future(post(client, 0))
        await wait_for(lambda: len(e.received) == 1)
        rest = [
            asyncio.ensure_future(post(client, 1, {TENANT_HEADER: "A"})),
            asyncio.ensure_future(post(client, 2, {TENANT_HEADER: "A"})),
            asyncio.ensure_future(post(client, 3, {TENANT_HEADER: "B", PRIORITY_HEADER: "2"})),
        ]
        await wait_for(lambda: queued(gw) == 3)
        metrics = await (await client.get("/metrics")).text()
        assert 'kvmesh_router_flow_queue_depth{priority="0",tenant="A"} 2.0' in metrics
        assert 'kvmesh_router_flow_queue_depth{priority="2",tenant="B"} 1.0' in metrics
        assert "kvmesh_router_flow_queued_requests 3.0" in metrics
        e.gate.set()
        await asyncio.gather(head, *rest)
        metrics = await (await client.get("/metrics")).text()
        assert "kvmesh_router_flow_queued_requests 0.0" in metrics
        assert 'kvmesh_router_flow_queue_wait_seconds_count{outcome="dispatched"} 3.0' in metrics


async def test_bad_flow_headers_are_400(engines):
    (e,) = await engines(1)
    async with gateway([e], ONE_AT_A_TIME) as (_, client):
        for headers in ({PRIORITY_HEADER: "high"}, {MAX_QUEUE_WAIT_HEADER: "-5"}, {PRIORITY_HEADER: "1e99"}):
            resp, body = await post(client, 0, headers)
            assert resp.status == 400, headers
            assert json.loads(body)["error"]["code"] == 400


async def test_off_switch_routes_everything_at_once(engines):
    (e,) = await engines(1)
    e.gate = asyncio.Event()
    async with gateway([e], {**ONE_AT_A_TIME, "enabled": False}) as (gw, client):
        assert gw.flow_gate is None
        pending = [asyncio.ensure_future(post(client, i)) for i in range(4)]
        await wait_for(lambda: len(e.received) == 4)  # nothing held back
        e.gate.set()
        for resp, _ in await asyncio.gather(*pending):
            assert resp.status == 200 and QUEUE_WAIT_HEADER not in resp.headers


async def test_default_config_does_not_hold_back_below_saturation(engines):
    es = await engines(2)
    async with gateway(es, None, policy="precise") as (gw, client):
        assert gw.flow_gate is not None  # on by default
        results = await asyncio.gather(*(post(client, i) for i in range(40)))
        assert all(r.status == 200 and r.headers[QUEUE_WAIT_HEADER] == "0" for r, _ in results)
        assert gw.flow_gate.controller.stats.num_queued == 0


async def test_requests_let_through_go_only_to_endpoints_below_the_bound(engines):
    es = await engines(2)
    preferred, other = es
    other.waiting = 50  # the queue scorer alone would send everything to `preferred`
    preferred.gate = asyncio.Event()
    scheduler = {
        "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [
            {"name": "default", "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}]}
        ],
    }
    async with gateway(es, ONE_AT_A_TIME, scheduler=scheduler) as (gw, client):
        await wait_for(lambda: gw.pool.get(other.url).state.waiting == 50)  # type: ignore[union-attr]
        first = asyncio.ensure_future(post(client, 0))
        await wait_for(lambda: len(preferred.received) == 1)
        # `preferred` is at its bound (and holds its request): the other one takes this one
        resp, _ = await asyncio.wait_for(post(client, 1), timeout=5)
        assert resp.status == 200 and resp.headers["x-kvmesh-endpoint"] == other.url
        preferred.gate.set()
        await first
