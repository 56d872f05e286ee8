"""store_bridge: a real KVCacheEngine driven from synchronous code; slow or dead stores are misses."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from store_hosts import BlackHole, SlowLink

from kvmesh.core.hashing import Namespace
from kvmesh.core.net import free_port
from kvmesh.integrations.store_bridge import StoreBridge
from kvmesh.store.config import StoreConfig
from kvmesh.store.local_server import LocalServer, find_server_binary

NS = Namespace("m", kv_dtype="float16", kv_layout="L2xH2xD4")


def _kv(num_tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 2, 2, num_tokens, 4)).astype(np.float16)


@pytest.fixture
def black_hole() -> Iterator[BlackHole]:
    server = BlackHole()
    try:
        yield server
    finally:
        server.close()


def test_save_lookup_retrieve_round_trip(tmp_path: Path) -> None:
    config = StoreConfig(chunk_size=32, shared_dir=str(tmp_path))
    tokens = list(range(1000, 1100))
    kv = _kv(100)
    with StoreBridge(config) as bridge:
        assert bridge.chunk_size == 32
        assert bridge.lookup(tokens, NS) == 0
        assert bridge.retrieve(tokens, NS).num_tokens == 0
        assert bridge.save(tokens, NS, kv)
        assert bridge.drain(10.0)
        assert bridge.lookup(tokens, NS) == 96  # whole chunks only
        got = bridge.retrieve(tokens, NS, max_tokens=70)
        assert got.num_tokens == 64 and got.kv is not None
        assert np.array_equal(got.kv, kv[:, :, :, :64])
        assert bridge.stats.num_saves == 1 and bridge.stats.num_timeouts == 0
    # a second process-like bridge over the same shared directory sees the chunks
    with StoreBridge(config) as other:
        got = other.retrieve(tokens, NS)
        assert got.num_tokens == 96 and got.tier == "fs"
        assert got.kv is not None and np.array_equal(got.kv, kv[:, :, :, :96])
        assert (
            other.lookup(tokens[:50], Namespace("m", tenant="t2", kv_dtype="float16", kv_layout="L2xH2xD4"))
            == 0
        )


def test_save_rejects_misshapen_kv() -> None:
    with StoreBridge("memory") as bridge:
        with pytest.raises(ValueError, match="L, 2, H"):
            bridge.save(list(range(10)), NS, _kv(20))
        with pytest.raises(ValueError, match="L, 2, H"):
            bridge.save(list(range(10)), NS, np.zeros((2, 3, 2, 4, 4), np.float16))


def test_dead_store_is_a_miss() -> None:
    config = StoreConfig(chunk_size=32, local_cpu=False, remote_url=f"redis://127.0.0.1:{free_port()}/0")
    with StoreBridge(config, lookup_timeout_s=2.0, retrieve_timeout_s=2.0) as bridge:
        tokens = list(range(64))
        assert bridge.lookup(tokens, NS) == 0
        assert bridge.retrieve(tokens, NS).kv is None
        assert bridge.save(tokens, NS, _kv(64))
        assert bridge.wait_for_saves(5.0)
        assert bridge.stats.num_saves_failed == 0  # the store turns tier trouble into misses


def test_hung_store_times_out_into_misses_and_refuses_past_max_inflight(black_hole: BlackHole) -> None:
    config = StoreConfig(
        chunk_size=32,
        local_cpu=False,
        remote_url=black_hole.url,
        remote_timeout_s=30.0,
        breaker_failures=100,
    )
    bridge = StoreBridge(
        config, lookup_timeout_s=0.05, retrieve_timeout_s=0.05, max_inflight=2, close_timeout_s=2.0
    )
    try:
        tokens = list(range(64))
        assert bridge.lookup(tokens, NS) == 0
        assert bridge.retrieve(tokens, NS).kv is None
        assert bridge.stats.num_timeouts == 2
        # both calls still hang on the store: a third is refused without waiting
        assert bridge.lookup(tokens, NS) == 0
        assert not bridge.save(tokens, NS, _kv(64))
        assert bridge.stats.num_refused == 2
        assert bridge.stats.num_timeouts == 2
    finally:
        bridge.close()
    assert not bridge.save(list(range(64)), NS, _kv(64))  # closed


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="positive"):
        StoreBridge("memory", lookup_timeout_s=0)
    with pytest.raises(ValueError, match="positive"):
        StoreBridge("memory", max_inflight=0)
    from kvmesh.errors import ConfigError

    with pytest.raises(ConfigError):
        StoreBridge("nope://x")


@pytest.mark.valkey
def test_a_pinned_save_is_pinned_and_a_refused_one_is_counted() -> None:
    if find_server_binary("valkey") is None:
        pytest.skip("valkey-server binary not found")
    with LocalServer(
        "valkey", maxmemory_bytes=64 << 20, extra_args=["--maxmemory-policy", "volatile-lru"]
    ) as srv:
        config = StoreConfig(
            chunk_size=32,
            local_cpu=False,
            remote_url=srv.url,
            redis_ttl_s=3600,
            max_pinned_remote_size=2500 / (1 << 30),  # one ~1 KiB chunk pinned fits, three do not
            pin_tenant_budgets={"t2": {"redis": 0.0}},
        )
        tokens = list(range(1000, 1100))
        other = Namespace("m", tenant="t2", kv_dtype="float16", kv_layout="L2xH2xD4")
        with StoreBridge(config) as bridge:
            assert bridge.save(tokens[:32], NS, _kv(32), pin_ttl_s=60.0)
            assert bridge.save(tokens, NS, _kv(100, seed=1))  # not pinned
            assert bridge.drain(10.0)
            assert bridge.stats.num_pins == 1 and bridge.stats.num_pins_refused == 0
            client = bridge.engine.tiered.tiers[0].backend._client  # type: ignore[attr-defined]
            keys = [
                bridge.engine.tiered.tiers[0].backend._key(k) for k in bridge.engine.chunk_keys(tokens, NS)
            ]  # type: ignore[attr-defined]
            ttls = [bridge._submit_unbounded(client.pttl(k)).result(5) for k in keys]
            assert ttls[0] == -1 and all(t > 0 for t in ttls[1:]), ttls
            # pinning the whole prompt would take three chunks: over the budget, refused whole
            assert bridge.pin(tokens, NS, 60.0)
            assert bridge.drain(10.0)
            assert bridge.stats.num_pins_refused == 1
            assert [bridge._submit_unbounded(client.pttl(k)).result(5) > 0 for k in keys[1:]] == [True, True]
            # a tenant without a budget is not asked at all
            assert bridge.save(tokens, other, _kv(100, seed=2), pin_ttl_s=60.0)
            assert bridge.drain(10.0)
            assert (bridge.stats.num_pins, bridge.stats.num_pins_refused) == (1, 1)


@pytest.fixture
def slow_redis() -> Iterator[SlowLink]:
    """A real redis-server behind a link that holds each reply 0.3 s."""
    if find_server_binary("redis") is None:
        pytest.skip("redis-server binary not found")
    with LocalServer("redis") as server:
        link = SlowLink(("127.0.0.1", server.port), delay_s=0.3)
        try:
            yield link
        finally:
            link.close()


def test_a_slow_lookup_is_polled_until_it_answers(slow_redis: SlowLink) -> None:
    config = StoreConfig(chunk_size=32, local_cpu=False, remote_url=slow_redis.url, remote_timeout_s=5.0)
    tokens = list(range(1000, 1100))
    with StoreBridge(config, lookup_timeout_s=0.05) as bridge:
        assert bridge.save(tokens, NS, _kv(100))
        assert bridge.drain(20.0)
        assert bridge.lookup(tokens, NS) == 0, "a blocking lookup waits one slice: the slow store is a miss"
        pending = bridge.begin_lookup(tokens, NS, deadline_s=10.0)
        polls = [bridge.poll_lookup(pending, 0.05)]
        while polls[-1] is None and len(polls) < 400:
            polls.append(bridge.poll_lookup(pending, 0.05))
        assert polls[0] is None and polls[-1] == 96, polls
        assert bridge.stats.num_timeouts == 1  # the blocking lookup's, not the polled one's


def test_a_hung_lookup_is_a_miss_at_its_deadline(black_hole: BlackHole) -> None:
    config = StoreConfig(
        chunk_size=32,
        local_cpu=False,
        remote_url=black_hole.url,
        remote_timeout_s=30.0,
    )
    with StoreBridge(config, close_timeout_s=2.0) as bridge:
        tokens = list(range(64))
        pending = bridge.begin_lookup(tokens, NS, deadline_s=0.3)
        assert bridge.poll_lookup(pending, 0.05) is None
        assert bridge.stats.num_timeouts == 0
        started = time.monotonic()
        while (found := bridge.poll_lookup(pending, 0.05)) is None:
            assert time.monotonic() - started < 5.0, "the deadline never came"
        assert found == 0 and bridge.stats.num_timeouts == 1
