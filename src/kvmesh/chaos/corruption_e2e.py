"""Corrupt chunks in the shared tier under the fleet's engines: the output must equal a cold run's.

Engine 0 computes a new prompt cold and writes its KV to the shared server. A control prompt shows
engine 1 then loading such KV from there (cached tokens > 0) with the same greedy output. For the
test prompt, every chunk written meanwhile has one bit flipped in the server before engine 1 is
asked: it must serve none of it (0 cached tokens) and answer exactly what the cold run answered.
"""

from __future__ import annotations

import math
import random
from typing import Any

import redis.asyncio as aioredis

from kvmesh.chaos.bounds import ScenarioResult
from kvmesh.chaos.context import ChaosContext, poll_until
from kvmesh.errors import FleetError

PROMPT_TOKENS = 336
"""One full 256-token store chunk and a tail."""
OUTPUT_TOKENS = 16
ENGINE_KEYS = "kvmesh:*"
"""The engines' chunks in the server (the default key prefix)."""


async def _complete(ctx: ChaosContext, url: str, tokens: list[int]) -> tuple[str, int]:
    """Greedy completion of ``tokens`` on one engine: (text, cached prompt tokens)."""
    body = {
        "model": ctx.model,
        "prompt": tokens,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    async with ctx.session.post(url + "/v1/completions", json=body) as resp:
        data: Any = await resp.json()
        if resp.status != 200:
            raise AssertionError(f"{url}: HTTP {resp.status}: {data}")
    details = data["usage"].get("prompt_tokens_details") or {}
    return str(data["choices"][0]["text"]), int(details.get("cached_tokens") or 0)


async def _keys(client: aioredis.Redis) -> set[bytes]:
    return {k async for k in client.scan_iter(match=ENGINE_KEYS, count=1000)}


async def _cold_then_written(
    ctx: ChaosContext, client: aioredis.Redis, tokens: list[int]
) -> tuple[str, set[bytes]]:
    """Run ``tokens`` cold on engine 0 and wait for its KV in the server; (text, keys written since)."""
    before = await _keys(client)
    text, cached = await _complete(ctx, ctx.fleet.engine_urls[0], tokens)
    assert cached == 0, f"a new prompt was served {cached} cached tokens on its first run"
    new: set[bytes] = set()

    async def written() -> bool:
        nonlocal new
        new = await _keys(client) - before
        return bool(new)

    if math.isnan(await poll_until(written, 10.0, 0.1)):
        raise FleetError("engine 0 wrote no KV to the shared server within 10 s")
    return text, new


async def shared_tier_corruption(ctx: ChaosContext) -> ScenarioResult:
    """See the module docstring. Bounds: control loads from the store with equal output; corrupt
    chunks give 0 cached tokens and the cold output."""
    res = ScenarioResult("corruption_e2e", "4b. corrupt shared-tier chunks under the engines")
    url = ctx.fleet.store_url
    if url is None or len(ctx.fleet.engine_urls) < 2:
        raise FleetError("needs a shared server and two engines")
    rng = random.Random(44)
    control, test = ([rng.randrange(3, ctx.vocab_size) for _ in range(PROMPT_TOKENS)] for _ in range(2))
    other = ctx.fleet.engine_urls[1]
    client = aioredis.Redis.from_url(url.replace("valkey://", "redis://", 1))
    try:
        control_cold, _ = await _cold_then_written(ctx, client, control)
        control_text, control_cached = await _complete(ctx, other, control)
        test_cold, written = await _cold_then_written(ctx, client, test)
        for key in written:
            value = await client.get(key)
            if isinstance(value, bytes) and value:
                flipped = bytearray(value)
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
                await client.set(key, bytes(flipped))
        test_text, test_cached = await _complete(ctx, other, test)
    finally:
        await client.aclose()
    res.figures.update(
        control_cached_tokens=control_cached, chunks_corrupted=len(written), test_cached_tokens=test_cached
    )
    res.check("control: tokens loaded from the shared tier", control_cached, ">=", 256)
    res.check("control: output differs from cold", int(control_text != control_cold), "==", 0)
    res.check("corrupt: tokens served from the shared tier", test_cached, "==", 0)
    res.check("corrupt: output differs from cold", int(test_text != test_cold), "==", 0)
    return res
