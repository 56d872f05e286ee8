"""Tenants stay apart: identical prompts from two tenants share nothing, and admin needs the token."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import numpy as np

from kvmesh.bench.metrics import RequestResult
from kvmesh.bench.runner import RunOptions, send_request
from kvmesh.bench.workloads import RequestSpec
from kvmesh.chaos.bounds import ScenarioResult
from kvmesh.chaos.context import ChaosContext
from kvmesh.core.hashing import Namespace
from kvmesh.router.gateway import TENANT_HEADER
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


async def _ask(ctx: ChaosContext, tokens: list[int], tenant: str, url: str, n: int) -> RequestResult:
    options = RunOptions(
        base_url=url, model=ctx.model, stream=False, headers={TENANT_HEADER: tenant}, progress=False
    )
    spec = RequestSpec(
        request_id=f"tenant-{tenant}-{n}", arrival_s=0.0, prompt_token_ids=tokens, output_len=4
    )
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        result = await send_request(session, spec, options, ctx.log.t0)
    if not result.ok:
        raise AssertionError(f"tenant {tenant} request {n} failed: {result.error}")
    return result


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
    """Tenant A sends a prompt twice, tenant B sends the same prompt (router, then straight to the
    engine that holds A's blocks); the admin API is called without its token.

    Bounds: tenant B's first request has 0 cached tokens through the router and on A's engine; B's
    request adds its own index entries; the store finds none of A's chunks for B; A's repeat does
    hit (so the check is not vacuous); every tokenless admin call is answered 401.
    """
    res = ScenarioResult("tenants", "6. tenants stay apart; admin needs the token")
    rng = random.Random(16)
    tokens = [rng.randrange(3, ctx.vocab_size) for _ in range(PROMPT_TOKENS)]
    a1 = await _ask(ctx, tokens, "tenant-a", ctx.router_url, 1)
    await asyncio.sleep(EVENT_SETTLE_S)
    a2 = await _ask(ctx, tokens, "tenant-a", ctx.router_url, 2)
    await asyncio.sleep(EVENT_SETTLE_S)
    keys_before_b = await ctx.index_keys()
    b1 = await _ask(ctx, tokens, "tenant-b", ctx.router_url, 1)
    await asyncio.sleep(EVENT_SETTLE_S)
    keys_after_b = await ctx.index_keys()
    engine_a = a2.endpoint or a1.endpoint or ctx.fleet.engine_urls[0]
    c1 = await _ask(ctx, tokens, "tenant-c", engine_a, 1)
    admin_calls, admin_wrong = await _admin_without_token(ctx)
    store_hits = await _store_cross_tenant_hits()
    res.figures.update(
        tenant_a_repeat_cached_tokens=a2.cached_tokens,
        tenant_b_router_endpoint=b1.endpoint or "",
        tenant_a_endpoint=engine_a,
        index_keys_added_by_tenant_b=keys_after_b - keys_before_b,
        admin_calls_without_token=admin_calls,
    )
    if admin_wrong:
        res.figures["admin_not_401"] = "; ".join(admin_wrong[:5])
    res.check("tenant A's repeat: cached tokens", a2.cached_tokens, ">=", 1)
    res.check("tenant B via router: cached tokens", b1.cached_tokens, "==", 0)
    res.check("tenant C on tenant A's engine: cached tokens", c1.cached_tokens, "==", 0)
    res.check("index keys added by tenant B", keys_after_b - keys_before_b, ">=", PROMPT_TOKENS // BLOCK_SIZE)
    res.check("store chunks found across tenants", store_hits, "==", 0)
    res.check("admin calls without a valid token not answered 401", len(admin_wrong), "==", 0)
    return res
