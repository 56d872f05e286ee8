"""TieredStore: prefix reads across tiers, write-through, promotion, queues, single-flight,
breakers, timeouts and corruption."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
from store_helpers import FlakyBackend, build_backend, corrupt_bytes, make_chunk, make_key

from kvmesh.errors import TierUnavailableError
from kvmesh.store.backends.base import Backend
from kvmesh.store.backends.memory import MemoryBackend
from kvmesh.store.breaker import BreakerState, CircuitBreaker
from kvmesh.store.codec import ChunkCodec
from kvmesh.store.keys import StoreKey
from kvmesh.store.tiered import Tier, TieredStore

KEYS = [make_key(i) for i in range(6)]


def chunks(keys: list[StoreKey]) -> list[tuple[StoreKey, bytes]]:
    return [(k, make_chunk(k, seed=n)) for n, k in enumerate(keys)]


def two_tier(slow: Backend | None = None, **slow_opts: object) -> tuple[TieredStore, MemoryBackend, Backend]:
    fast = MemoryBackend(1 << 30)
    slow = slow if slow is not None else MemoryBackend(1 << 30)
    tiers = [Tier("cpu", fast), Tier("slow", slow, **slow_opts)]  # type: ignore[arg-type]
    return TieredStore(tiers, ChunkCodec()), fast, slow


async def test_prefix_spans_tiers_and_a_gap_truncates() -> None:
    store, fast, slow = two_tier()
    items = chunks(KEYS)
    await fast.put_many([items[0], items[1], items[4]])
    await slow.put_many([items[2]])
    assert await store.count_prefix(KEYS) == 3
    result = await store.get_prefix(KEYS)
    assert [c.tier for c in result.chunks] == ["cpu", "cpu", "slow"]
    assert [c.chunk.header.key for c in result.chunks] == [k.chunk for k in KEYS[:3]]
    assert await store.count_prefix([KEYS[3], KEYS[4]]) == 0
    await store.aclose()


async def test_hits_in_slow_tier_are_promoted() -> None:
    store, fast, slow = two_tier()
    await slow.put_many(chunks(KEYS[:3]))
    first = await store.get_prefix(KEYS[:3])
    assert [c.tier for c in first.chunks] == ["slow"] * 3
    assert await fast.exists_many(KEYS[:3]) == [True] * 3
    second = await store.get_prefix(KEYS[:3])
    assert [c.tier for c in second.chunks] == ["cpu"] * 3
    assert store.tiers[0].counters.promotions == 3
    await store.aclose()


async def test_write_through_inline_and_queued() -> None:
    slow = FlakyBackend()
    store, fast, _ = two_tier(slow, queued=True)
    await store.put(chunks(KEYS[:2]))
    assert await fast.exists_many(KEYS[:2]) == [True, True]
    await store.drain()
    assert await slow.inner.exists_many(KEYS[:2]) == [True, True]
    await store.put(chunks(KEYS[:2]))
    await store.drain()
    assert slow.calls["put"] == 1, "chunks the tier already holds are not written again"
    assert store.tiers[1].counters.bytes_written == sum(len(v) for _, v in chunks(KEYS[:2]))
    await store.aclose()


async def test_full_write_queue_drops_and_counts_without_blocking() -> None:
    slow = FlakyBackend()
    slow.delay_s = 0.2
    one = len(make_chunk(KEYS[0]))
    store, _, _ = two_tier(slow, queued=True, max_queue_bytes=2 * one)
    for key, value in chunks(KEYS):
        await store.put([(key, value)])
    assert store.tiers[1].counters.dropped_writes == 4
    assert store.tiers[1].queue_bytes == 2 * one
    await store.drain()
    assert store.tiers[1].queue_bytes == 0
    assert sum(await slow.inner.exists_many(KEYS)) == 2
    await store.aclose()


async def test_single_flight_fetches_each_chunk_once() -> None:
    slow = FlakyBackend()
    await slow.inner.put_many(chunks(KEYS[:4]))
    store, _, _ = two_tier(slow)
    tiers = store.tiers
    tiers[0].promote = False
    slow.delay_s = 0.05
    results = await asyncio.gather(*(store.get_prefix(KEYS[:4]) for _ in range(5)))
    assert all(r.num_chunks == 4 for r in results)
    assert sorted(slow.keys_fetched, key=lambda k: k.chunk) == KEYS[:4]
    await store.aclose()


async def test_failing_tier_gives_misses_and_opens_breaker() -> None:
    now = [0.0]
    slow = FlakyBackend()
    await slow.inner.put_many(chunks(KEYS[:2]))
    breaker = CircuitBreaker(failure_threshold=2, backoff_s=1.0, clock=lambda: now[0])
    store, _, _ = two_tier(slow, breaker=breaker)
    slow.fail = True
    for _ in range(4):
        assert (await store.get_prefix(KEYS[:2])).num_chunks == 0
    assert breaker.state is BreakerState.OPEN
    counters = store.tiers[1].counters
    assert counters.unavailable == 2
    assert counters.breaker_rejections == 2
    calls_while_open = dict(slow.calls)
    assert await store.count_prefix(KEYS[:2]) == 0
    assert slow.calls == calls_while_open, "an open breaker must not touch the tier"
    slow.fail = False
    now[0] += 1.0
    assert (await store.get_prefix(KEYS[:2])).num_chunks == 2
    assert breaker.state is BreakerState.CLOSED
    await store.aclose()


async def test_slow_tier_times_out_into_a_miss() -> None:
    slow = FlakyBackend()
    await slow.inner.put_many(chunks(KEYS[:1]))
    slow.delay_s = 5.0
    store, _, _ = two_tier(slow, timeout_s=0.05)
    assert await store.count_prefix(KEYS[:1]) == 0
    assert store.tiers[1].counters.timeouts == 1
    await store.aclose()


async def test_failed_queued_writes_are_counted_as_dropped() -> None:
    slow = FlakyBackend()
    slow.fail = True
    store, fast, _ = two_tier(slow, queued=True)
    await store.put(chunks(KEYS[:3]))
    await store.drain()
    assert await fast.exists_many(KEYS[:3]) == [True] * 3
    assert store.tiers[1].counters.dropped_writes == 3
    await store.aclose()


async def test_corrupt_fast_copy_falls_back_to_slow_tier_and_heals() -> None:
    store, fast, slow = two_tier()
    items = chunks(KEYS[:3])
    await slow.put_many(items)
    await fast.put_many([(items[1][0], corrupt_bytes(items[1][1], "flip")), items[0], items[2]])
    result = await store.get_prefix(KEYS[:3])
    assert [c.tier for c in result.chunks] == ["cpu", "slow", "cpu"]
    assert store.tiers[0].counters.corrupt == 1
    assert await fast.get_many([KEYS[1]]) == [items[1][1]], "the good copy was promoted back"
    await store.aclose()


@pytest.mark.parametrize("kind", ["memory", "disk", "fs", "redis", "valkey"])
@pytest.mark.parametrize("mode", ["flip", "truncate"])
async def test_corruption_in_every_tier_is_never_served(
    kind: str, mode: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    backend = build_backend(kind, tmp_path, request)
    store = TieredStore([Tier(kind, backend, timeout_s=5.0)], ChunkCodec())
    items = chunks(KEYS[:3])
    await store.put(items)
    for seed in range(3):
        await backend.put_many([(items[1][0], corrupt_bytes(items[1][1], mode, seed))])
        result = await store.get_prefix(KEYS[:3])
        assert result.num_chunks == 1, "a corrupt chunk ends the prefix"
        assert store.tiers[0].counters.corrupt == seed + 1
        assert await backend.exists_many([KEYS[1]]) == [False], "a corrupt chunk is deleted"
    await backend.flush(None)
    await store.aclose()


async def test_a_long_read_is_verified_on_several_threads_in_order() -> None:
    """Over 1 MiB of chunks is checked on worker threads in slices: results keep the keys' order,
    and a corrupt chunk in the middle of a slice still ends the prefix there."""
    keys = [make_key(i) for i in range(13)]
    items = [(k, make_chunk(k, tokens=8192, seed=n)) for n, k in enumerate(keys)]  # 512 KiB each
    store, fast, _ = two_tier()
    await fast.put_many(items)
    result = await store.get_prefix(keys)
    assert [c.chunk.header.key for c in result.chunks] == [k.chunk for k in keys]
    await fast.put_many([(keys[7], corrupt_bytes(items[7][1], "flip"))])
    result = await store.get_prefix(keys)
    assert result.num_chunks == 7 and store.tiers[0].counters.corrupt == 1
    await store.aclose()


async def test_flush_by_group_and_stats() -> None:
    store, _, _ = two_tier()
    other = StoreKey("00000000000000bb", KEYS[0].chunk)
    await store.put(chunks(KEYS[:2]) + chunks([other]))
    removed = await store.flush(KEYS[0].group)
    assert removed == {"cpu": 2, "slow": 2}
    assert await store.count_prefix([other]) == 1
    stats = await store.stats()
    tiers = stats["tiers"]
    assert isinstance(tiers, dict)
    assert tiers["cpu"]["backend"]["num_chunks"] == 1
    assert tiers["slow"]["breaker"] == "closed"
    await store.aclose()


async def test_metrics_render_per_instance() -> None:
    store_a, _, _ = two_tier()
    store_b, _, _ = two_tier()
    await store_a.put(chunks(KEYS[:2]))
    await store_a.get_prefix(KEYS[:2])
    text_a = store_a.metrics.render().decode()
    text_b = store_b.metrics.render().decode()
    assert 'kvmesh_store_chunk_hits_total{tier="cpu"} 2.0' in text_a
    assert 'kvmesh_store_chunk_hits_total{tier="cpu"} 0.0' in text_b
    assert 'kvmesh_store_breaker_state{tier="slow"} 0.0' in text_a
    assert "kvmesh_store_op_seconds_bucket" in text_a
    await store_a.aclose()
    await store_b.aclose()


def test_duplicate_tier_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="unique"):
        TieredStore([Tier("cpu", MemoryBackend(10)), Tier("cpu", MemoryBackend(10))], ChunkCodec())


class SlowPuts(FlakyBackend):
    """Writes take ``put_delay_s``; everything else is instant."""

    put_delay_s = 0.3

    async def put_many(self, items: Sequence[tuple[StoreKey, bytes]]) -> int:
        await asyncio.sleep(self.put_delay_s)
        return await super().put_many(items)


async def test_write_timeout_grows_with_the_bytes_written() -> None:
    """A healthy tier that needs 0.3 s for a write: a small write over a 0.2 s limit is dropped,
    a 4 MiB one gets 0.05 s more per MiB and lands."""
    slow = SlowPuts()
    store, _, _ = two_tier(slow, timeout_s=0.2, queued=True)
    await store.put([(KEYS[0], make_chunk(KEYS[0]))])
    await store.drain()
    assert store.tiers[1].counters.timeouts == 1
    big = make_chunk(KEYS[1], tokens=32_768)
    assert len(big) >= 4 << 20
    await store.put([(KEYS[1], big)])
    await store.drain()
    assert await slow.inner.exists_many([KEYS[0], KEYS[1]]) == [False, True]
    assert store.tiers[1].counters.timeouts == 1
    await store.aclose()


class SlowGets(FlakyBackend):
    """Reads take ``get_delay_s``; everything else is instant."""

    get_delay_s = 0.3

    async def get_many(self, keys: Sequence[StoreKey]) -> list[bytes | None]:
        await asyncio.sleep(self.get_delay_s)
        return await super().get_many(keys)


async def test_read_timeout_grows_with_the_chunks_asked_for() -> None:
    """A healthy tier that needs 0.3 s for a read, under a 0.2 s limit: while the store knows no
    chunk size the read is a miss; once it expects 16 MiB chunks, one key gets 0.16 s more and hits."""
    slow = SlowGets()
    big = make_chunk(KEYS[0], tokens=131_072)
    assert len(big) >= 16 << 20
    await slow.inner.put_many([(KEYS[0], big)])
    store, _, _ = two_tier(slow, timeout_s=0.2)
    assert store.chunk_bytes == 0
    assert (await store.get_prefix(KEYS[:1])).num_chunks == 0
    assert store.tiers[1].counters.timeouts == 1
    store.expect_chunk_bytes(len(big))
    assert (await store.get_prefix(KEYS[:1])).num_chunks == 1
    assert store.tiers[1].counters.timeouts == 1
    await store.aclose()


class _Recorder:
    """Collects ``on_written`` reports: (tier, keys)."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, list[StoreKey]]] = []

    def __call__(self, tier: str, keys: list[StoreKey]) -> None:
        self.reports.append((tier, list(keys)))


class _PutFails(FlakyBackend):
    """Answers ``exists`` but every ``put`` fails, or stores one item fewer than given (``short``)."""

    def __init__(self, short: bool = False) -> None:
        super().__init__()
        self.short = short

    async def put_many(self, items: Sequence[tuple[StoreKey, bytes]]) -> int:
        if not self.short:
            raise TierUnavailableError("injected put failure")
        return await self.inner.put_many(list(items)[:-1])


async def test_put_reports_per_tier_what_it_holds_now() -> None:
    slow = FlakyBackend()
    await slow.inner.put_many(chunks(KEYS[:1]))
    store, _, _ = two_tier(slow, queued=True)
    seen = _Recorder()
    await store.put(chunks(KEYS[:3]), seen)
    assert seen.reports == [("cpu", KEYS[:3])], "the queued tier reports only once its worker wrote"
    await store.drain()
    # Held already (KEYS[0]) counts as held, followed by what was written now.
    assert seen.reports == [("cpu", KEYS[:3]), ("slow", KEYS[:3])]
    await store.put(chunks(KEYS[:2]), seen)
    await store.drain()
    assert seen.reports[2:] == [("cpu", KEYS[:2]), ("slow", KEYS[:2])], "all present: reported as held"
    await store.aclose()


@pytest.mark.parametrize("failure", ["put_raises", "exists_fails", "breaker_open", "queue_full"])
async def test_a_dropped_tier_write_reports_nothing(failure: str) -> None:
    slow = _PutFails() if failure == "put_raises" else FlakyBackend()
    opts: dict[str, object] = {"queued": True}
    if failure == "breaker_open":
        opts["breaker"] = CircuitBreaker(failure_threshold=1, backoff_s=30.0)
    if failure == "queue_full":
        opts["max_queue_bytes"] = len(make_chunk(KEYS[3])) - 1
    store, _, _ = two_tier(slow, **opts)
    if failure == "breaker_open":
        slow.fail = True
        assert await store.count_prefix(KEYS[:1]) == 0
        slow.fail = False
        assert store.tiers[1].breaker.state is BreakerState.OPEN
    slow.fail = failure == "exists_fails"
    if failure == "queue_full":
        await store.put(chunks(KEYS[:1]))  # taken (the queue was empty), and still queued below
    seen = _Recorder()
    await store.put(chunks(KEYS[3:4]), seen)
    await store.drain()
    assert seen.reports == [("cpu", KEYS[3:4])]
    assert store.tiers[1].counters.dropped_writes == 1
    await store.aclose()


async def test_a_write_larger_than_the_queue_cap_is_taken_when_nothing_waits() -> None:
    """One long prompt is more than the cap: dropping it whole on an idle tier would keep long
    prompts out of the store for good; behind other queued writes it is dropped."""
    slow = FlakyBackend()
    big = chunks(KEYS[:3])
    store, _, _ = two_tier(slow, queued=True, max_queue_bytes=len(big[0][1]))
    await store.put(big)
    await store.put(chunks(KEYS[3:5]))  # the first is still queued: over the cap, dropped
    await store.drain()
    assert await slow.inner.exists_many(KEYS[:5]) == [True, True, True, False, False]
    assert store.tiers[1].counters.dropped_writes == 2
    await store.aclose()


async def test_a_short_put_reports_only_keys_held_before() -> None:
    slow = _PutFails(short=True)
    await slow.inner.put_many(chunks(KEYS[:1]))
    store, _, _ = two_tier(slow, queued=True)
    seen = _Recorder()
    await store.put(chunks(KEYS[:3]), seen)
    await store.drain()
    assert seen.reports == [("cpu", KEYS[:3]), ("slow", KEYS[:1])]
    await store.aclose()
