"""Tenants stay apart: identical prompts from two tenants share nothing, and admin needs the token."""

from __future__ import annotations

import asyncio
import random

import numpy as np

from kvmesh.chaos.bounds import ScenarioResult
from kvmesh.chaos.context import ChaosContext
from kvmesh.core.hashing import Namespace
from kvmesh.core.tenancy import ENDPOINT_HEADER, TENANT_HEADER
from kvmesh.store.cache_engine import KVCacheEngine
from kvmesh.store.config import StoreConfig

PROMPT_TOKENS = 400
BLOCK_SIZE = 16
EVENT_SETTLE_S = 0.5
"""Time for the engines' KV events to reach the router's index."""
ADMIN_ROUTES = (
    ("GET", "/admin/endpoints"),
    ("POST", "/admin/endpoints"),
    ("DELETE", "/admin/endpoints"),
    ("POST", "/admin/flush"),
    ("GET", "/admin/index"),
)


async def _ask(
    ctx: ChaosContext, url: str, tokens: list[int], *, tenant: str = "", salt: str = ""
) -> tuple[int, str]:
    """A non-streamed completion: through the router with the tenant header, or straight to an
    engine with ``cache_salt`` (what the router adds for a tenant); (cached tokens, endpoint)."""
    body: dict[str, object] = {"model": ctx.model, "prompt": tokens, "max_tokens": 4, "ignore_eos": True}
    if salt:
        body["cache_salt"] = salt
    headers = {TENANT_HEADER: tenant} if tenant else {}
    async with ctx.session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise AssertionError(f"{url} ({tenant or salt}): HTTP {resp.status}: {data}")
        endpoint = resp.headers.get(ENDPOINT_HEADER, url)
    details = data["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0), endpoint


async def _flush_tenant(ctx: ChaosContext, tenant: str) -> int:
    """Drop ``tenant``'s entries from the router's index; how many there were."""
    headers = {"Authorization": f"Bearer {ctx.admin_token}"}
    async with ctx.session.post(
        ctx.router_url + "/admin/flush", json={"tenant": tenant}, headers=headers
    ) as resp:
        return int((await resp.json())["flushed"])


async def _admin_without_token(ctx: ChaosContext) -> tuple[int, list[str]]:
    """Calls of every admin route with no token and with a wrong one; (count, non-401 answers)."""
    wrong: list[str] = []
    count = 0
    for auth in (None, "Bearer not-the-token", "Basic YWRtaW46YWRtaW4="):
        for method, path in ADMIN_ROUTES:
            headers = {"Authorization": auth} if auth else {}
            body = b'{"url": "http://127.0.0.1:1"}' if method != "GET" else None
            async with ctx.session.request(method, ctx.router_url + path, headers=headers, data=body) as resp:
                count += 1
                if resp.status != 401:
                    wrong.append(f"{method} {path} ({auth or 'no token'}): {resp.status}")
    return count, wrong


async def _store_cross_tenant_hits(num_prompts: int = 32) -> int:
    """Chunks one tenant's lookups find of another tenant's identical prompts, in a store."""
    engine = KVCacheEngine.from_config(StoreConfig(chunk_size=64))
    rng = random.Random(6)
    kv = np.ones((2, 2, 2, 256, 8), np.float32)
    hits = 0
    try:
        for _ in range(num_prompts):
            tokens = [rng.randrange(3, 259) for _ in range(256)]
            await engine.store(tokens, Namespace("chaos", tenant="tenant-a"), kv)
            hits += await engine.lookup(tokens, Namespace("chaos", tenant="tenant-b")) // engine.chunk_size
            assert await engine.lookup(tokens, Namespace("chaos", tenant="tenant-a")) == 256, (
                "the store lost tenant A's chunks: the cross-tenant check would be vacuous"
            )
    finally:
        await engine.aclose()
    return hits


async def tenants_stay_apart(ctx: ChaosContext) -> ScenarioResult:
    """Tenant A sends a prompt through the router, then again straight to the engine that took it;
    tenant B sends the same prompt through the router, tenant C straight to A's engine; the admin
    API is called without its token.

    Bounds: B and C get 0 cached tokens; A's repeat does hit (so the check is not vacuous); the
    router's index holds entries under each of A and B (counted by flushing them); a store finds
    none of A's chunks for B; every tokenless admin call is answered 401.
    """
    res = ScenarioResult("tenants", "6. tenants stay apart; admin needs the token")
    rng = random.Random(16)
    tokens = [rng.randrange(3, ctx.vocab_size) for _ in range(PROMPT_TOKENS)]
    _, engine_a = await _ask(ctx, ctx.router_url, tokens, tenant="tenant-a")
    a_repeat, _ = await _ask(ctx, engine_a, tokens, salt="tenant-a")
    await asyncio.sleep(EVENT_SETTLE_S)
    b_router, b_endpoint = await _ask(ctx, ctx.router_url, tokens, tenant="tenant-b")
    c_engine, _ = await _ask(ctx, engine_a, tokens, salt="tenant-c")
    await asyncio.sleep(EVENT_SETTLE_S)
    entries_a = await _flush_tenant(ctx, "tenant-a")
    entries_b = await _flush_tenant(ctx, "tenant-b")
    admin_calls, admin_wrong = await _admin_without_token(ctx)
    store_hits = await _store_cross_tenant_hits()
    res.figures.update(
        tenant_a_endpoint=engine_a,
        tenant_b_router_endpoint=b_endpoint,
        router_index_entries_tenant_a=entries_a,
        router_index_entries_tenant_b=entries_b,
        admin_calls_without_token=admin_calls,
    )
    if admin_wrong:
        res.figures["admin_not_401"] = "; ".join(admin_wrong[:5])
    blocks = (PROMPT_TOKENS - 1) // BLOCK_SIZE
    res.check("tenant A's repeat on its engine: cached tokens", a_repeat, ">=", 1)
    res.check("tenant B via router: cached tokens", b_router, "==", 0)
    res.check("tenant C on tenant A's engine: cached tokens", c_engine, "==", 0)
    res.check("router index entries of tenant A", entries_a, ">=", blocks)
    res.check("router index entries of tenant B (its own)", entries_b, ">=", blocks)
    res.check("store chunks found across tenants", store_hits, "==", 0)
    res.check("admin calls without a valid token not answered 401", len(admin_wrong), "==", 0)
    return res
