"""Pins in the shared tiers: real redis-server / valkey-server under ``volatile-lru`` and a real shared
directory with a byte budget.

Each test floods a tier with unpinned prompts until it evicts, and checks what a pinned prompt
does: survives while pinned, is released (evictable again) once its TTL ends, stays within its
tenant's budget, and cannot be touched by another tenant.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvmesh.core.hashing import Namespace
from kvmesh.core.types import BlockKey
from kvmesh.store.backends.fs_pins import PINS_DIR
from kvmesh.store.backends.memory import MemoryBackend
from kvmesh.store.backends.redis import RedisBackend
from kvmesh.store.cache_engine import KVCacheEngine
from kvmesh.store.config import StoreConfig
from kvmesh.store.factory import build_store
from kvmesh.store.keys import StoreKey
from kvmesh.store.local_server import LocalServer, find_server_binary
from kvmesh.store.pins import GB, PinRequest

CHUNK = 256
SHAPE = (2, 2, 2, CHUNK, 64)
"""One chunk of float16 KV: 256 KiB of payload."""
CHUNK_BYTES = int(np.prod(SHAPE)) * 2
NS = Namespace("pin-model", revision="r1", tenant="acme")


def prompt(seed: int, num_chunks: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 30_000, size=num_chunks * CHUNK)]


def kv_for(tokens: list[int]) -> np.ndarray:
    rng = np.random.default_rng(len(tokens) + tokens[0])
    shape = (*SHAPE[:3], len(tokens), SHAPE[4])
    return rng.standard_normal(shape).astype(np.float16)


def markers(root: Path) -> dict[str, float]:
    """The shared directory's pin markers and their deadlines."""
    return {
        p.name: p.stat().st_mtime
        for p in (root / PINS_DIR).rglob("*")
        if p.is_file() and not p.name.startswith(".")
    }


def engine(config: StoreConfig) -> KVCacheEngine:
    return KVCacheEngine(build_store(config), config)


async def write(store: KVCacheEngine, tokens: list[int], ns: Namespace = NS) -> None:
    await store.store(tokens, ns, kv_for(tokens))
    await store.drain()


async def flood(store: KVCacheEngine, first_seed: int, num_prompts: int) -> list[list[int]]:
    prompts = [prompt(first_seed + i) for i in range(num_prompts)]
    for tokens in prompts:
        await write(store, tokens)
    return prompts


async def flood_after_release(store: KVCacheEngine, first_seed: int, num_prompts: int) -> None:
    """Flood once the expired pins are released and the released chunks are plainly the oldest.

    The first write releases them (``PEXPIRE`` counts as a use: their LRU clock reads "now"), and
    the server's LRU clock ticks once a second, so chunks written in the same second tie with them
    and the approximate LRU may keep either. Two ticks later every chunk of the flood is younger.
    """
    await flood(store, first_seed, 1)
    await asyncio.sleep(2.1)
    await flood(store, first_seed + 1, num_prompts - 1)


def volatile_server(flavor: str, maxmemory: int) -> Iterator[LocalServer]:
    if find_server_binary(flavor) is None:
        pytest.skip(f"{flavor}-server binary not found")
    server = LocalServer(
        flavor,
        maxmemory_bytes=maxmemory,
        # many samples: the server's LRU is approximate, and the tests ask which chunk went first
        extra_args=["--maxmemory-policy", "volatile-lru", "--maxmemory-samples", "64"],
    ).start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(params=["redis", "valkey"])
def volatile(request: pytest.FixtureRequest) -> Iterator[LocalServer]:
    """A server of each flavor capped at 6 MiB that evicts only keys with a TTL."""
    yield from volatile_server(request.param, 6 << 20)


def remote_config(url: str, *, budget_bytes: int = 4 * CHUNK_BYTES, **extra: object) -> StoreConfig:
    return StoreConfig(
        local_cpu=False,
        remote_url=url,
        redis_ttl_s=3600,
        redis_key_prefix=f"pins{os.getpid()}",
        max_pinned_remote_size=budget_bytes / GB,
        remote_timeout_s=5.0,
        **extra,  # type: ignore[arg-type]
    )


def shared_config(root: Path, *, budget_bytes: int = 4 * CHUNK_BYTES) -> StoreConfig:
    return StoreConfig(
        local_cpu=False,
        shared_dir=str(root),
        max_shared_dir_size=(12 * CHUNK_BYTES) / GB,
        max_pinned_shared_dir_size=budget_bytes / GB,
    )


# ------------------------------------------------------------------ redis / valkey


async def test_a_pinned_prefix_survives_a_flood_that_evicts_unpinned_chunks(volatile: LocalServer) -> None:
    store = engine(remote_config(volatile.url))
    try:
        pinned = prompt(1, num_chunks=2)
        await write(store, pinned)
        outcome = (await store.pin(pinned, NS, 60.0))["redis"]
        assert outcome is not None and outcome.accepted
        assert (outcome.num_pinned, outcome.num_missing, outcome.added_bytes) == (2, 0, outcome.used_bytes)

        flooded = await flood(store, 100, 40)  # ~10 MiB into a 6 MiB server

        assert await store.lookup(pinned, NS) == 2 * CHUNK
        held = [await store.lookup(tokens, NS) for tokens in flooded]
        assert held.count(0) >= 10, "the flood did not evict: the test proves nothing"
    finally:
        await store.aclose()


async def test_an_expired_pin_becomes_ordinary_data_and_is_evicted(volatile: LocalServer) -> None:
    store = engine(remote_config(volatile.url))
    try:
        pinned = prompt(2)
        await write(store, pinned)
        outcome = (await store.pin(pinned, NS, 1.0))["redis"]
        assert outcome is not None and outcome.accepted
        await asyncio.sleep(1.5)
        # Writers release expired pins before they write; the flood then evicts it like any chunk.
        await flood_after_release(store, 200, 40)
        assert await store.lookup(pinned, NS) == 0
    finally:
        await store.aclose()


async def test_repinning_extends_and_never_shortens_a_pin(volatile: LocalServer) -> None:
    store = engine(remote_config(volatile.url))
    try:
        pinned = prompt(3)
        await write(store, pinned)
        long = (await store.pin(pinned, NS, 30.0))["redis"]
        short = (await store.pin(pinned, NS, 1.0))["redis"]
        assert long is not None and short is not None and short.accepted
        assert short.added_bytes == 0, "a re-pin charged the budget twice"
        assert short.used_bytes == long.used_bytes
        await asyncio.sleep(1.5)
        await flood(store, 300, 40)
        assert await store.lookup(pinned, NS) == CHUNK, "the shorter re-pin cut the first pin short"
    finally:
        await store.aclose()


async def test_a_pin_over_the_budget_is_refused_and_evicts_no_other_pin(volatile: LocalServer) -> None:
    # Two engines on one server share the tenant's budget through the server's ledger.
    one = engine(remote_config(volatile.url, budget_bytes=int(2.5 * CHUNK_BYTES)))
    two = engine(remote_config(volatile.url, budget_bytes=int(2.5 * CHUNK_BYTES)))
    try:
        first, second = prompt(4, num_chunks=2), prompt(5, num_chunks=1)
        await write(one, first)
        await write(two, second)
        taken = (await one.pin(first, NS, 60.0))["redis"]
        assert taken is not None and taken.accepted

        check = (await two.pin(second, NS, 60.0, estimate_chunk_bytes=CHUNK_BYTES))["redis"]
        refused = (await two.pin(second, NS, 60.0))["redis"]
        assert check is not None and not check.accepted and check.over_budget
        assert refused is not None and not refused.accepted and refused.over_budget
        message = refused.refusal("acme")
        assert "pin budget exceeded" in message and "'redis'" in message and "acme" in message
        assert str(int(2.5 * CHUNK_BYTES)) in message

        await flood(one, 400, 40)
        assert await one.lookup(first, NS) == 2 * CHUNK, "the refused pin cost the first pin its place"
        assert await two.lookup(second, NS) == 0, "the refused chunk was pinned anyway"
    finally:
        await one.aclose()
        await two.aclose()


async def test_a_tenant_cannot_pin_or_extend_another_tenants_chunks(volatile: LocalServer) -> None:
    store = engine(remote_config(volatile.url))
    other = Namespace(NS.model, revision=NS.revision, tenant="intruder")
    try:
        tokens = prompt(6)
        await write(store, tokens)
        mine = (await store.pin(tokens, NS, 1.0))["redis"]
        theirs = (await store.pin(tokens, other, 600.0))["redis"]
        assert mine is not None and mine.accepted
        assert theirs is not None and (theirs.num_pinned, theirs.num_missing, theirs.used_bytes) == (0, 1, 0)
        await asyncio.sleep(1.5)
        await flood_after_release(store, 500, 40)
        assert await store.lookup(tokens, NS) == 0, "another tenant's pin extended this tenant's chunk"
    finally:
        await store.aclose()


async def test_an_allkeys_policy_server_refuses_pins_with_the_reason() -> None:
    if find_server_binary("redis") is None:
        pytest.skip("redis-server binary not found")
    with LocalServer("redis", maxmemory_bytes=6 << 20) as server:
        store = engine(remote_config(server.url))
        try:
            tokens = prompt(7)
            await write(store, tokens)
            outcome = (await store.pin(tokens, NS, 60.0))["redis"]
            assert outcome is not None and not outcome.accepted and not outcome.over_budget
            assert "allkeys-lru" in outcome.refusal("acme") and "volatile-lru" in outcome.refusal("acme")
        finally:
            await store.aclose()


# ------------------------------------------------------------------ shared directory


async def test_shared_dir_budget_evicts_unpinned_chunks_and_keeps_pinned_ones(tmp_path: Path) -> None:
    store = engine(shared_config(tmp_path))
    try:
        pinned = prompt(11, num_chunks=2)
        await write(store, pinned)
        outcome = (await store.pin(pinned, NS, 60.0))["fs"]
        assert outcome is not None and outcome.accepted and outcome.num_pinned == 2

        flooded = await flood(store, 600, 30)  # 30 chunks into a 12-chunk directory

        assert await store.lookup(pinned, NS) == 2 * CHUNK
        held = [await store.lookup(tokens, NS) for tokens in flooded]
        assert held[0] == 0 and held[-1] == CHUNK, "oldest written must go first"
        stats = await store.tiered.tiers[0].backend.stats()
        assert stats.num_bytes <= stats.capacity_bytes and stats.num_evictions >= 18
    finally:
        await store.aclose()


async def test_shared_dir_pin_expiry_releases_the_chunk(tmp_path: Path) -> None:
    store = engine(shared_config(tmp_path))
    try:
        pinned = prompt(12)
        await write(store, pinned)
        outcome = (await store.pin(pinned, NS, 1.0))["fs"]
        assert outcome is not None and outcome.accepted
        await asyncio.sleep(1.2)
        await flood(store, 700, 30)
        assert await store.lookup(pinned, NS) == 0
    finally:
        await store.aclose()


async def test_shared_dir_budget_is_shared_by_engines_and_refuses_past_it(tmp_path: Path) -> None:
    one = engine(shared_config(tmp_path, budget_bytes=int(2.5 * CHUNK_BYTES)))
    two = engine(shared_config(tmp_path, budget_bytes=int(2.5 * CHUNK_BYTES)))
    try:
        first, second = prompt(13, num_chunks=2), prompt(14)
        await write(one, first)
        await write(two, second)
        assert (await one.pin(first, NS, 60.0))["fs"].accepted  # type: ignore[union-attr]
        refused = (await two.pin(second, NS, 60.0))["fs"]
        assert refused is not None and refused.over_budget
        assert "'fs'" in refused.refusal("acme")
        assert len(await asyncio.to_thread(markers, tmp_path)) == 2
    finally:
        await one.aclose()
        await two.aclose()


async def test_shared_dir_tenant_cannot_pin_another_tenants_chunks(tmp_path: Path) -> None:
    store = engine(shared_config(tmp_path))
    other = Namespace(NS.model, revision=NS.revision, tenant="intruder")
    try:
        tokens = prompt(15)
        await write(store, tokens)
        mine = (await store.pin(tokens, NS, 30.0))["fs"]
        theirs = (await store.pin(tokens, other, 600.0))["fs"]
        assert mine is not None and mine.accepted
        assert theirs is not None and (theirs.num_pinned, theirs.num_missing) == (0, 1)
        deadlines = list((await asyncio.to_thread(markers, tmp_path)).values())
        assert len(deadlines) == 1 and deadlines[0] < time.time() + 31
    finally:
        await store.aclose()


async def test_pin_ttl_longer_than_the_configured_maximum_is_caller_misuse(tmp_path: Path) -> None:
    store = engine(shared_config(tmp_path))
    try:
        with pytest.raises(ValueError, match="ttl_s"):
            await store.pin(prompt(16), NS, store.pin_max_ttl_s + 1)
    finally:
        await store.aclose()


async def test_a_pinned_chunk_another_writer_rewrote_is_made_persistent_again(volatile: LocalServer) -> None:
    store = engine(remote_config(volatile.url))
    try:
        tokens = prompt(8)
        await write(store, tokens)
        assert (await store.pin(tokens, NS, 60.0))["redis"].accepted  # type: ignore[union-attr]
        backend = store.tiered.tiers[0].backend
        assert isinstance(backend, RedisBackend)
        name = backend._key(store.chunk_keys(tokens, NS)[0])
        # a second engine that found the chunk missing a moment earlier writes it too
        await backend._client.set(name, await backend._client.get(name), px=3_600_000)
        assert await backend._client.pttl(name) > 0
        await backend.pins.release_expired()
        assert await backend._client.pttl(name) == -1
    finally:
        await store.aclose()


# ------------------------------------------------------------------ RAM tier (best effort)


def ram_key(i: int) -> StoreKey:
    return StoreKey("00000000000000cd", BlockKey(i.to_bytes(16, "big")))


async def test_the_ram_tier_passes_pinned_chunks_over_until_their_deadline() -> None:
    backend = MemoryBackend(10 * 1000)
    await backend.put_many([(ram_key(i), b"x" * 1000) for i in range(2)])
    outcome = await backend.pins.pin_many(PinRequest([ram_key(0), ram_key(1)], "acme", 1.0, 5000))
    assert outcome.accepted and outcome.used_bytes == 2000
    await backend.put_many([(ram_key(i), b"y" * 1000) for i in range(100, 130)])
    assert await backend.exists_many([ram_key(0), ram_key(1), ram_key(100)]) == [True, True, False]
    assert backend.num_evictions == 22

    await asyncio.sleep(1.1)
    await backend.put_many([(ram_key(i), b"z" * 1000) for i in range(200, 210)])
    assert await backend.exists_many([ram_key(0), ram_key(1)]) == [False, False]
    assert len(backend.pins) == 0


async def test_a_ram_tier_full_of_pins_refuses_the_new_chunk_and_budgets_hold() -> None:
    backend = MemoryBackend(3 * 1000)
    await backend.put_many([(ram_key(i), b"x" * 1000) for i in range(3)])
    assert (await backend.pins.pin_many(PinRequest([ram_key(0), ram_key(1)], "acme", 60.0, 2000))).accepted
    over = await backend.pins.pin_many(PinRequest([ram_key(2)], "acme", 60.0, 2000))
    assert over.over_budget and over.added_bytes == 1000
    assert (await backend.pins.pin_many(PinRequest([ram_key(2)], "beta", 60.0, 2000))).accepted
    assert await backend.put_many([(ram_key(9), b"y" * 1000)]) == 0
    assert await backend.exists_many([ram_key(i) for i in (0, 1, 2, 9)]) == [True, True, True, False]
    await backend.delete_many([ram_key(2)])
    assert len(backend.pins) == 2 and await backend.put_many([(ram_key(9), b"y" * 1000)]) == 1


async def test_the_store_pins_in_the_ram_tier_within_its_budget(tmp_path: Path) -> None:
    config = StoreConfig(
        max_local_cpu_size=(12 * CHUNK_BYTES) / GB,
        max_pinned_local_cpu_size=(3 * CHUNK_BYTES) / GB,
    )
    store = engine(config)
    try:
        pinned = prompt(21, num_chunks=2)
        await write(store, pinned)
        outcomes = await store.pin(pinned, NS, 60.0)
        assert set(outcomes) == {"cpu"} and outcomes["cpu"] is not None and outcomes["cpu"].accepted
        await flood(store, 900, 30)
        assert await store.lookup(pinned, NS) == 2 * CHUNK
        more = prompt(22, num_chunks=2)
        await write(store, more)
        refused = (await store.pin(more, NS, 60.0))["cpu"]
        assert refused is not None and refused.over_budget and "'cpu'" in refused.refusal("acme")
    finally:
        await store.aclose()
