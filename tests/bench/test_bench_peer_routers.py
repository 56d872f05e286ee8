"""sglang-router and vllm-router (routers kvmesh did not write) in front of kvmesh engines, unchanged.

Two emulated engines; each peer configuration registers both, routes completions and chats to them,
and sends a repeated prompt back to the engine that cached it. Runs when the peer is installed in its
virtualenv (``scripts/install-peers.sh``); skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from kvmesh.bench.route_counts import GENERATION_ROUTES, PREPARATION_ROUTES, num_requests, scrape_route_counts
from kvmesh.fleet import Fleet, FleetConfig
from kvmesh.fleet.peer_routers import (
    PEER_EVENTS_TOPIC,
    PEER_ROUTERS,
    PeerRouterSpec,
    peer_unavailable_reason,
    start_peer_router,
)
from kvmesh.workload import synthetic_text

pytestmark = pytest.mark.slow

SPECS = [
    *PEER_ROUTERS.values(),
    # no --kv-event-source: vllm-router finds each stream through the engine's /kv_event_sources
    PeerRouterSpec("vllm-kv_aware-discovered", "vllm", "kv_aware"),
]
CASES = [
    pytest.param(
        spec,
        id=spec.name,
        marks=pytest.mark.skipif(
            (reason := peer_unavailable_reason(spec.kind)) is not None, reason=str(reason)
        ),
    )
    for spec in SPECS
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tmp_path_factory) -> AsyncIterator[Fleet]:
    config = FleetConfig(
        num_engines=2,
        model="tiny-random-llama",
        emulate="tiny-h100",
        shared="none",
        start_router=False,
        engine_args=["--events-topic", PEER_EVENTS_TOPIC],
        run_dir=tmp_path_factory.mktemp("peer-fleet"),
        health_timeout_s=120,
    )
    async with Fleet(config) as fleet:
        yield fleet


async def _send(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Send one request (streamed when asked) and return the final usage and the model name."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=60)) as resp:
        assert resp.status == 200, f"{path}: HTTP {resp.status} {await resp.text()}"
        if not body.get("stream"):
            data = await resp.json()
            return {"model": data["model"], "usage": data["usage"]}
        out: dict[str, Any] = {}
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                out["model"] = chunk["model"]
                if chunk.get("usage"):
                    out["usage"] = chunk["usage"]
        return out


@pytest.mark.parametrize("spec", CASES)
@pytest.mark.asyncio(loop_scope="module")
async def test_peer_router_routes_to_kvmesh_engines(fleet: Fleet, spec: PeerRouterSpec) -> None:
    await fleet.reset_engine_caches()
    async with aiohttp.ClientSession() as session:
        async with session.get(fleet.engine_urls[0] + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        router = await start_peer_router(
            spec, fleet.engines, model=model, block_size=16, log_dir=fleet.logs_dir, timeout_s=90
        )
        try:
            before = await scrape_route_counts(session, fleet.engine_urls)
            bodies: list[dict[str, Any]] = []
            for k in range(2):
                prompt = synthetic_text(random.Random(k), 120)
                bodies.append({"model": model, "prompt": prompt, "max_tokens": 4})
                bodies.append({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
                               "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
            results = []
            for repeat in range(3):
                for body in bodies:
                    results.append((repeat, await _send(session, router.url, body)))
                    # KV events reach the router asynchronously; a pause lets kv_aware see them
                    await asyncio.sleep(0.3)
            after = await scrape_route_counts(session, fleet.engine_urls)
        finally:
            await router.stop()
    served = num_requests(after - before, GENERATION_ROUTES, ok_only=True)
    assert served == len(results), f"engines served {served} of {len(results)} routed requests"
    assert all(r["model"] == model and r["usage"]["prompt_tokens"] > 32 for _, r in results)
    repeats = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for repeat, r in results if repeat > 0]
    # every peer here is cache-aware: a repeated prompt goes back to the engine that holds it
    assert all(cached > 0 for cached in repeats), repeats
    preparation = num_requests(after - before, PREPARATION_ROUTES)
    if spec.kind == "vllm":
        # vllm-router asks every worker for the prompt's ids before each routing decision
        assert preparation >= len(results) * len(fleet.engines)
    else:
        assert preparation == 0
