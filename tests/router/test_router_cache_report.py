"""Cache usage and miss reasons end to end: the router in front of in-process emulated kvmesh engines.

Each miss reason is produced on purpose and checked in the ``x-kvmesh-cache`` header, in the
reason counters and in ``/admin/explain``; ``cached_tokens`` in the router's answers equals the
engine's, streamed and not; a tenant's header never reflects another tenant's prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from router_fakes import FakeEngine

from kvmesh.core.cache_usage import CACHE_HEADER, REQUEST_ID_HEADER
from kvmesh.engine.app import EngineOptions, build_engine
from kvmesh.engine.server import EngineServer
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.endpoints import normalize_url
from kvmesh.router.gateway import ENDPOINT_HEADER, Gateway
from kvmesh.router.types import RoutingRequest

pytestmark = pytest.mark.slow

AUTH = {"Authorization": "Bearer s3cret"}

# A router profile where the queue outweighs the cached prefix: a busy holder loses the request.
LOAD_FIRST = {
    "plugins": [
        {"type": "precise-prefix-cache-scorer"},
        {"type": "queue-scorer"},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "precise-prefix-cache-scorer", "weight": 1},
                {"pluginRef": "queue-scorer", "weight": 3},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 40_000 + 100 for i in range(n)]


def parse_cache_header(value: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in value.split(";"))


async def until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def engines(n: int, **options: Any) -> AsyncIterator[list[EngineServer]]:
    started: list[EngineServer] = []
    try:
        for _ in range(n):
            opts = EngineOptions(
                model="smollm2",
                emulate="tiny-h100",
                events="tcp://127.0.0.1:0",
                events_replay="tcp://127.0.0.1:0",
                stream_interval=0.0,
                **options,
            )
            server = await build_engine(opts)
            await server.start("127.0.0.1", 0)
            started.append(server)
        yield started
    finally:
        for server in started:
            await server.stop()


@contextlib.asynccontextmanager
async def router(urls: list[str], **overrides: Any) -> AsyncIterator[tuple[Gateway, TestClient]]:
    raw: dict[str, Any] = {
        "endpoints": [{"url": u} for u in urls],
        "policy": "precise",
        "adminToken": "s3cret",
        "seed": 1,
        "flowControl": {"enabled": False},
        "health": {"intervalS": 0.25, "timeoutS": 2.0, "failureThreshold": 3, "metricsIntervalS": 0.5},
    }
    tokenizer = overrides.pop("tokenizer", None)
    raw.update(overrides)
    gw = Gateway(router_config_from_dict(raw), tokenizer=tokenizer)
    client = TestClient(TestServer(gw.app))
    await client.start_server()
    try:
        await until(lambda: gw.pool is not None and sum(s.healthy for s in gw.pool.states()) == len(urls))
        await until(lambda: gw.applier is not None)
        yield gw, client
    finally:
        await client.close()


def indexed_tokens(gw: Gateway, prompt: list[int], pod: str, tenant: str = "") -> int:
    assert gw.applier is not None
    match = gw.scheduler.match(RoutingRequest("probe", prompt, gw.applier.namespace(tenant=tenant)))
    return match.hit_tokens(pod) if pod in match.pods or match.shared is not None else 0


async def complete(
    client: TestClient, prompt: Any, *, tenant: str | None = None, chat: bool = False, **extra: Any
) -> tuple[dict[str, str], dict[str, Any], Any]:
    """One non-streamed request: (parsed x-kvmesh-cache, usage, response)."""
    headers = {} if tenant is None else {"x-tenant-id": tenant}
    body: dict[str, Any] = {"max_tokens": 2, "temperature": 0, **extra}
    if chat:
        body["messages"] = prompt
    else:
        body["prompt"] = prompt
    resp = await client.post(
        "/v1/chat/completions" if chat else "/v1/completions", json=body, headers=headers
    )
    answer = await resp.json()
    assert resp.status == 200, answer
    return parse_cache_header(resp.headers[CACHE_HEADER]), answer["usage"], resp


async def reason_count(client: TestClient, reason: str) -> float:
    text = await (await client.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith(f'kvmesh_router_cache_requests_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no counter for {reason}")


async def test_cold_then_partial_block_and_usage_equals_the_engines(tmp_path: Path):
    async with engines(1) as fleet, router([fleet[0].url]) as (gw, client):
        pod = normalize_url(fleet[0].url)
        prompt = tokens(1, 100)
        header, usage, resp = await complete(client, prompt)
        assert header["reason"] == "cold" and header["cached"] == "0" and header["prompt"] == "100"
        assert "predicted" not in header
        assert resp.headers[REQUEST_ID_HEADER].startswith("kvm-")
        assert await reason_count(client, "cold") == 1
        await until(lambda: indexed_tokens(gw, prompt, pod) == 96)
        header, usage, resp = await complete(client, prompt)
        # the engine serves the 6 full blocks and computes the trailing partial one
        assert usage["prompt_tokens_details"]["cached_tokens"] == 96
        assert usage["prompt_tokens_details"]["kvmesh_cached_tokens_by_tier"] == {"GPU": 96}
        assert header["reason"] == "partial_block" and header["cached"] == "96" and header["missed"] == "4"
        assert header["tiers"] == "GPU:96"
        assert await reason_count(client, "partial_block") == 1
        # streamed with include_usage: the header carries the engine's own figure (sent with its
        # first token), and the usage chunk has the same number
        resp = await client.post(
            "/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            headers={REQUEST_ID_HEADER: "client-id-1"},
        )
        assert resp.status == 200
        raw = await resp.read()
        header = parse_cache_header(resp.headers[CACHE_HEADER])
        assert resp.headers[REQUEST_ID_HEADER] == "client-id-1"
        chunks = [msgspec.json.decode(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
        streamed = next(c["usage"] for c in chunks if c.get("usage"))
        assert streamed["prompt_tokens_details"]["cached_tokens"] == 96 == int(header["cached"])
        assert "predicted" not in header and header["reason"] == "partial_block"
        explained = await (await client.get("/admin/explain/client-id-1", headers=AUTH)).json()
        assert explained["verdict"]["cached_tokens"] == 96 and explained["engine_reported"] is True
        assert explained["endpoints"][0]["endpoint"] == pod and explained["endpoints"][0]["chosen"]
        assert (await client.get("/admin/explain/nope", headers=AUTH)).status == 404
        assert (await client.get("/admin/explain/client-id-1")).status == 401
        # the engine's own counter agrees with what the router reported (96 twice)
        engine_metrics = await (await client.session.get(f"{fleet[0].url}/metrics")).text()
        gpu = next(
            line
            for line in engine_metrics.splitlines()
            if line.startswith("kvmesh:cached_tokens_total") and 'tier="GPU"' in line
        )
        assert float(gpu.rsplit(" ", 1)[1]) == 192
        usage_report = await (await client.get("/admin/usage", headers=AUTH)).json()
        assert usage_report["tenants"][""]["cached_tokens"] == 192
        assert usage_report["tenants"][""]["prompt_tokens"] == 300
        assert usage_report["tenants"][""]["cached_by_tier"] == {"GPU": 192}


async def test_routed_for_load_names_the_lost_tokens_and_the_deciding_terms_and_not_to_other_tenants():
    async with (
        engines(2) as fleet,
        router([e.url for e in fleet], scheduler=LOAD_FIRST, health={"metricsIntervalS": 3600.0}) as (
            gw,
            client,
        ),
    ):
        assert gw.pool is not None
        prompt = tokens(2, 200)
        _, _, resp = await complete(client, prompt, tenant="acme")
        holder = resp.headers[ENDPOINT_HEADER]
        await until(lambda: indexed_tokens(gw, prompt, holder, tenant="acme") == 192)
        # the holder looks busy: the queue term outweighs its cached prefix
        busy = next(e for e in gw.pool.endpoints if e.state.pod == holder)
        busy.state.waiting = 50
        header, usage, resp = await complete(client, prompt + [7] * 20, tenant="acme")
        assert resp.headers[ENDPOINT_HEADER] != holder
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert header["reason"] == "routed_for_load" and header["by"] == "192"
        terms = dict(t.split(":") for t in header["terms"].split(","))
        assert float(terms["queue-scorer"]) > 0 > float(terms["precise-prefix-cache-scorer"])
        assert float(header["score"]) > float(header["holder_score"])
        assert await reason_count(client, "routed_for_load") == 1
        explained = await (
            await client.get(f"/admin/explain/{resp.headers[REQUEST_ID_HEADER]}", headers=AUTH)
        ).json()
        by_pod = {e["endpoint"]: e for e in explained["endpoints"]}
        assert by_pod[holder]["predicted_hit_tokens"] == 192 and not by_pod[holder]["chosen"]
        assert set(by_pod[holder]["terms"]) == {"precise-prefix-cache-scorer", "queue-scorer"}
        # another tenant sending the same prompt to the same busy fleet learns nothing of it
        header, _, resp = await complete(client, prompt + [7] * 20, tenant="globex")
        assert header["reason"] == "cold"
        assert set(header) == {"cached", "prompt", "reason"}


async def test_evicted_names_the_tier_and_another_tenant_sees_cold():
    async with engines(1, kv_capacity_tokens=512) as fleet, router([fleet[0].url]) as (gw, client):
        pod = normalize_url(fleet[0].url)
        prompt = tokens(3, 300)
        started = time.time()
        await complete(client, prompt, tenant="acme")
        await until(lambda: indexed_tokens(gw, prompt, pod, tenant="acme") == 288)
        for seed in (30, 31, 32):  # fills the 512-token device cache twice over
            await complete(client, tokens(seed, 300), tenant="acme")
        await until(lambda: indexed_tokens(gw, prompt, pod, tenant="acme") == 0)
        header, usage, _ = await complete(client, prompt, tenant="acme")
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert header["reason"] == "evicted" and header["tier"] == "GPU"
        assert 0 <= float(header["age_s"]) <= time.time() - started  # since its blocks were stored
        assert await reason_count(client, "evicted") == 1
        header, _, _ = await complete(client, prompt, tenant="globex")
        assert header["reason"] == "cold" and set(header) == {"cached", "prompt", "reason"}


async def test_block_size_mismatch_when_the_engine_blocks_are_no_multiple_of_the_routers():
    async with engines(1, block_size=24) as fleet, router([fleet[0].url]) as (gw, client):
        prompt = tokens(4, 200)
        header, _, _ = await complete(client, prompt)
        assert header["reason"] == "block_size_mismatch"
        assert header["engine_block"] == "24" and header["router_block"] == "16"
        await until(lambda: gw.applier is not None and gw.applier.stats.num_block_size_mismatch > 0)
        header, usage, _ = await complete(client, prompt + tokens(40, 100))
        assert usage["prompt_tokens_details"]["cached_tokens"] == 192  # the engine's 8 blocks of 24
        assert header["reason"] == "block_size_mismatch"
        assert await reason_count(client, "block_size_mismatch") == 2


async def test_tokenization_differs_when_the_same_text_comes_back_through_a_chat_template():
    from kvmesh.core.tokens import Tokenizer

    text = " ".join(f"Clause {i}: the tenant shall keep the premises in good repair." for i in range(12))
    async with (
        engines(1) as fleet,
        router([fleet[0].url], tokenizer=Tokenizer.load("smollm2")) as (_gw, client),
    ):
        header, _, _ = await complete(client, text, tenant="acme")
        assert header["reason"] == "cold"
        # the same words, now as a chat message: the template puts other ids in front
        header, usage, _ = await complete(
            client, [{"role": "user", "content": text}], tenant="acme", chat=True
        )
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert header["reason"] == "tokenization_differs"
        assert await reason_count(client, "tokenization_differs") == 1
        # the text another tenant sent tells this one nothing
        header, _, _ = await complete(client, [{"role": "user", "content": text}], tenant="globex", chat=True)
        assert header["reason"] == "cold"


async def test_store_fault_when_the_shared_tier_cannot_give_back_what_it_announced(tmp_path: Path):
    store = tmp_path / "shared"
    async with engines(2, store=f"file://{store}") as fleet, router([e.url for e in fleet]) as (gw, client):
        prompt = tokens(5, 600)  # two 256-token store chunks
        _, _, resp = await complete(client, prompt)
        writer = resp.headers[ENDPOINT_HEADER]
        assert gw.applier is not None
        probe = RoutingRequest("probe", prompt, gw.applier.namespace())
        await until(lambda: (m := gw.scheduler.match(probe)).shared is not None and m.shared.num_blocks == 32)
        for server in fleet:  # the writer's local copies would serve it: only the shared tier is left
            if normalize_url(server.url) == writer:
                await server.core.store_sync.wait()
        chunks = [p for p in store.rglob("*") if p.is_file()]
        assert chunks
        for path in chunks:  # the bytes rot on the shared disk
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        removed = await client.delete("/admin/endpoints", params={"url": writer}, headers=AUTH)
        assert removed.status == 200
        header, usage, resp = await complete(client, prompt)
        assert resp.headers[ENDPOINT_HEADER] != writer
        details = usage["prompt_tokens_details"]
        assert details["cached_tokens"] == 0 and details["kvmesh_store_fault"] is True
        assert header["reason"] == "store_fault" and header["tier"] == "SHARED"
        assert await reason_count(client, "store_fault") == 1


async def test_a_stream_from_an_engine_without_early_figures_says_predicted_and_explain_has_the_real_one():
    engine = await FakeEngine("v0").start()  # like vLLM: no x-kvmesh-cached header on its streams
    try:
        async with router([engine.url]) as (gw, client):
            prompt = tokens(6, 64)
            await complete(client, prompt)
            await until(lambda: indexed_tokens(gw, prompt, normalize_url(engine.url)) == 64)
            body = {"prompt": prompt, "stream": True, "stream_options": {"include_usage": True}}
            resp = await client.post("/v1/completions", json=body)
            raw = await resp.read()
            header = parse_cache_header(resp.headers[CACHE_HEADER])
            assert header["predicted"] == "1" and header["cached"] == "64"
            chunks = [msgspec.json.decode(ln[6:]) for ln in raw.split(b"\n") if ln.startswith(b"data: {")]
            streamed = next(c["usage"] for c in chunks if c.get("usage"))
            rid = resp.headers[REQUEST_ID_HEADER]
            explained = await (await client.get(f"/admin/explain/{rid}", headers=AUTH)).json()
            assert explained["sent_header"]["predicted"] is True
            assert explained["verdict"]["predicted"] is False
            assert (
                explained["verdict"]["cached_tokens"]
                == streamed["prompt_tokens_details"]["cached_tokens"]
                == 64
            )
            assert explained["verdict"]["reason"] == "none"
            usage = await (await client.get("/admin/usage", headers=AUTH)).json()
            assert usage["tenants"][""]["cached_by_tier"] == {"unknown": 64}
    finally:
        await engine.stop()


async def test_usage_per_tenant_is_bounded_and_exported():
    engine = await FakeEngine("v0").start()
    try:
        async with router([engine.url], cacheReport={"maxTenants": 2}) as (gw, client):
            for tenant in ("a", "b", "c", "d"):
                await complete(client, tokens(7, 40), tenant=tenant)
            gw.cache_report.ledger.add_prewarmed("a", 1000)
            report = (await (await client.get("/admin/usage", headers=AUTH)).json())["tenants"]
            assert set(report) == {"a", "b", "(other)"}
            assert report["(other)"]["requests"] == 2 and report["(other)"]["prompt_tokens"] == 80
            assert report["a"]["prewarmed_tokens"] == 1000
            text = await (await client.get("/metrics")).text()
            assert 'kvmesh_router_tenant_prompt_tokens_total{tenant="(other)"} 80.0' in text
            assert 'kvmesh_router_tenant_prewarmed_tokens_total{tenant="a"} 1000.0' in text
            assert 'tenant="c"' not in text
    finally:
        await engine.stop()
