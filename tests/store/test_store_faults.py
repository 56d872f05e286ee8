"""Fault tests against a real redis-server: killed mid-stream, black-holed (SIGSTOP), restarted.

No wall-clock assertions: the tests check what happened (timeouts counted, breaker state, calls
refused without touching the server, the event loop kept running), not how long it took.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvmesh.core.hashing import Namespace
from kvmesh.store.breaker import BreakerState
from kvmesh.store.cache_engine import KVCacheEngine
from kvmesh.store.config import StoreConfig
from kvmesh.store.local_server import LocalServer

NS = Namespace("faults-model")
CHUNK = 32


def _engine(url: str, **overrides: object) -> KVCacheEngine:
    options: dict[str, object] = {
        "chunk_size": CHUNK,
        "local_cpu": False,
        "remote_url": url,
        "remote_timeout_s": 0.3,
        "breaker_failures": 3,
        "breaker_backoff_s": 0.2,
        "breaker_max_backoff_s": 0.4,
    }
    options.update(overrides)
    return KVCacheEngine.from_config(StoreConfig(**options))  # type: ignore[arg-type]


def _prompt(i: int) -> tuple[list[int], np.ndarray]:
    tokens = [(i * 7919 + j) % 50_000 for j in range(2 * CHUNK)]
    kv = np.random.default_rng(i).standard_normal((2, 2, 2, 2 * CHUNK, 8)).astype(np.float32)
    return tokens, kv


async def test_killed_server_mid_stream_gives_misses_then_recovers(private_redis: LocalServer) -> None:
    engine = _engine(private_redis.url)
    redis_tier = engine.tiered.tiers[0]
    stored: list[list[int]] = []
    for i in range(12):
        if i == 6:
            private_redis.kill()
        tokens, kv = _prompt(i)
        await engine.store(tokens, NS, kv)
        await engine.drain()
        stored.append(tokens)
        for earlier in stored:
            result = await engine.retrieve(earlier, NS)
            if i < 6:
                assert result.num_tokens == 2 * CHUNK
                assert result.tier == "redis"
            else:
                assert result.num_tokens == 0
                assert result.kv is None
    counters = redis_tier.counters
    assert counters.unavailable >= 3
    assert counters.breaker_rejections > 0, "once open, the breaker refuses calls without trying"
    assert counters.dropped_writes >= 6
    assert redis_tier.breaker.state is BreakerState.OPEN
    stats = engine.stats()
    assert stats["tiers"]["redis"]["breaker"] == "open"  # type: ignore[index]

    private_redis.start()
    recovered = False
    for _ in range(200):
        tokens, kv = _prompt(100)
        await engine.store(tokens, NS, kv)
        await engine.drain()
        if (await engine.retrieve(tokens, NS)).num_tokens == 2 * CHUNK:
            recovered = True
            break
        await asyncio.sleep(0.05)
    assert recovered, "the store never used the restarted server"
    assert redis_tier.breaker.state is BreakerState.CLOSED
    await engine.aclose()


async def test_black_holed_server_costs_a_timeout_per_call_and_never_blocks_the_loop(
    private_redis: LocalServer,
) -> None:
    engine = _engine(
        private_redis.url, breaker_failures=2, breaker_backoff_s=30.0, breaker_max_backoff_s=30.0
    )
    tier = engine.tiered.tiers[0]
    tokens, kv = _prompt(1)
    await engine.store(tokens, NS, kv)
    await engine.drain()
    assert await engine.lookup(tokens, NS) == 2 * CHUNK

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticking = asyncio.create_task(ticker())
    private_redis.pause()
    try:
        before = ticks
        assert await engine.lookup(tokens, NS) == 0
        assert tier.counters.timeouts == 1
        assert ticks > before, "the event loop kept running while the call waited"
        assert (await engine.retrieve(tokens, NS)).num_tokens == 0
        assert tier.counters.timeouts == 2
        assert tier.breaker.state is BreakerState.OPEN
        for _ in range(20):
            assert await engine.lookup(tokens, NS) == 0
        assert tier.counters.timeouts == 2, "an open breaker costs no further timeouts"
        assert tier.counters.breaker_rejections == 20
        other_tokens, other_kv = _prompt(2)
        await engine.store(other_tokens, NS, other_kv)
        await engine.drain()
        assert tier.counters.dropped_writes >= 1
        metrics = engine.metrics.render().decode()
        assert 'kvmesh_store_breaker_state{tier="redis"} 2.0' in metrics
        assert 'kvmesh_store_errors_total{reason="timeout",tier="redis"} 2.0' in metrics
    finally:
        private_redis.resume()
        ticking.cancel()
    await engine.aclose()


async def test_paused_then_resumed_server_serves_correct_chunks(private_redis: LocalServer) -> None:
    engine = _engine(private_redis.url, breaker_backoff_s=0.05, breaker_max_backoff_s=0.05)
    prompts = [_prompt(i) for i in range(4)]
    for tokens, kv in prompts:
        await engine.store(tokens, NS, kv)
    await engine.drain()
    private_redis.pause()
    for tokens, _ in prompts:
        assert (await engine.retrieve(tokens, NS)).num_tokens == 0
    private_redis.resume()
    served = 0
    for _ in range(100):
        served = 0
        for tokens, kv in prompts:
            result = await engine.retrieve(tokens, NS)
            if result.num_tokens:
                assert result.kv is not None
                np.testing.assert_array_equal(result.kv, kv)
                served += 1
        if served == len(prompts):
            break
        await asyncio.sleep(0.05)
    assert served == len(prompts)
    await engine.aclose()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "valkey://127.0.0.1:1/0"])
async def test_unreachable_server_from_the_start(url: str) -> None:
    engine = _engine(url)
    tokens, kv = _prompt(3)
    await engine.store(tokens, NS, kv)
    await engine.drain()
    assert await engine.lookup(tokens, NS) == 0
    assert (await engine.retrieve(tokens, NS)).kv is None
    assert await engine.flush(NS) == 0
    await engine.aclose()
