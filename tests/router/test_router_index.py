"""One conformance suite for every BlockIndex backend, plus backend-specific behaviour."""

from __future__ import annotations

import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from kvmesh.core.net import free_port
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.errors import TierUnavailableError
from kvmesh.router.index import (
    ALL_MEDIA,
    InMemoryIndex,
    InstrumentedIndex,
    MediumSet,
    best_medium,
    media_of,
    medium_set,
)
from kvmesh.router.redis_index import RedisIndex
from kvmesh.router.write_behind import WriteBehindIndex

GPU = medium_set(Medium.GPU)
CPU = medium_set(Medium.CPU)
A, B, C = PodId("http://a:1"), PodId("http://b:1"), PodId("http://c:1")


def keys(n: int, tag: str = "k") -> list[BlockKey]:
    return [BlockKey(f"{tag}{i:014d}".encode()[:16].ljust(16, b"_")) for i in range(n)]


@pytest.fixture(params=["memory", "unbounded", "instrumented", "redis", "write-behind-redis"])
def index(request):
    if request.param == "memory":
        yield InMemoryIndex(1000)
    elif request.param == "unbounded":
        yield InMemoryIndex(None)
    elif request.param == "instrumented":
        yield InstrumentedIndex(InMemoryIndex(1000))
    else:
        url = request.getfixturevalue("redis_url")
        idx = RedisIndex(url, key_prefix=f"t{uuid.uuid4().hex[:8]}:")
        if request.param == "redis":
            yield idx
        else:
            writer = WriteBehindIndex(idx)
            writer.start()
            yield writer
            writer.close()
        idx.close()


def test_medium_sets():
    both = medium_set(Medium.CPU, Medium.GPU)
    assert best_medium(both) is Medium.GPU
    assert media_of(both) == [Medium.GPU, Medium.CPU]
    assert best_medium(medium_set(Medium.SHARED, Medium.DISK)) is Medium.DISK


def test_lookup_walks_prefix_and_stops_at_first_gap(index):
    ks = keys(6)
    index.add(ks[:4], A, GPU)
    index.add(ks[:2], B, CPU)
    index.add(ks[5:], A, GPU)  # beyond the gap at 4: never reached
    got = index.lookup(ks)
    assert len(got) == 4
    assert got[0] == {A: GPU, B: CPU}
    assert got[2] == {A: GPU}


def test_lookup_consumes_a_lazy_iterator_only_as_far_as_needed(index):
    ks = keys(10)
    index.add(ks[:3], A, GPU)
    pulled = []

    def gen():
        for k in ks:
            pulled.append(k)
            yield k

    assert len(index.lookup(gen())) == 3
    # memory stops right after the miss; redis pulls at most one pipeline group
    assert 4 <= len(pulled) <= 10


def test_tiers_accumulate_and_remove_per_tier(index):
    ks = keys(3)
    index.add(ks, A, GPU)
    index.add(ks[:2], A, CPU)
    assert index.lookup(ks)[0] == {A: medium_set(Medium.GPU, Medium.CPU)}
    index.remove(ks, A, GPU)
    got = index.lookup(ks)
    assert got == [{A: CPU}, {A: CPU}]
    index.remove(ks[:1], A, CPU)
    assert index.lookup(ks) == []


def test_remove_unknown_is_ignored_and_idempotent(index):
    ks = keys(2)
    index.remove(ks, A)
    index.add(ks, A, GPU)
    index.add(ks, A, GPU)
    index.remove(ks, B)
    assert len(index.lookup(ks)) == 2
    index.remove(ks, A)
    index.remove(ks, A)
    assert index.lookup(ks) == []


def test_clear_pod_drops_only_that_pod(index):
    def dropped(n: int) -> int | None:
        return None if isinstance(index, WriteBehindIndex) else n  # counted later, in the background

    ks = keys(5)
    index.add(ks, A, GPU)
    index.add(ks[:3], B, medium_set(Medium.GPU, Medium.CPU))
    assert index.clear_pod(B) == dropped(3)
    got = index.lookup(ks)
    assert len(got) == 5 and all(h == {A: GPU} for h in got)
    assert index.clear_pod(A) == dropped(5)
    assert index.lookup(ks) == []
    assert index.clear_pod(C) == dropped(0)


def test_stats_count_keys_and_entries(index):
    ks = keys(4)
    index.add(ks, A, GPU)
    index.add(ks[:2], B, GPU)
    stats = index.stats()
    assert (stats.num_keys, stats.num_entries) == (4, 6)
    index.remove(ks[:2], A, ALL_MEDIA)
    stats = index.stats()
    assert (stats.num_keys, stats.num_entries) == (4, 4)


def test_memory_lru_evicts_least_recently_used():
    idx = InMemoryIndex(capacity=4)
    ks = keys(6)
    idx.add(ks[:4], A, GPU)
    idx.lookup(ks[:1])  # touch key 0
    idx.add(ks[4:6], A, GPU)  # evicts keys 1 and 2
    assert idx.stats().num_keys == 4
    assert idx.stats().num_evicted == 2
    assert idx.lookup([ks[0]]) == [{A: GPU}]
    assert idx.lookup([ks[1]]) == []
    assert idx.lookup([ks[2]]) == []
    assert idx.lookup(ks[3:6]) == [{A: GPU}] * 3
    assert idx.stats().num_entries == 4


def test_unbounded_index_never_evicts():
    idx = InMemoryIndex(capacity=None)
    ks = keys(50)
    for i in range(0, 50, 5):
        idx.add(ks[i : i + 5], A, GPU)
    idx.add(ks[:10], B, CPU)
    stats = idx.stats()
    assert (stats.num_keys, stats.num_entries, stats.num_evicted, stats.capacity) == (50, 60, 0, None)
    assert idx.lookup(ks) == [{A: GPU, B: CPU}] * 10 + [{A: GPU}] * 40


def test_memory_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        InMemoryIndex(0)


def test_instrumented_counts_operations():
    idx = InstrumentedIndex(InMemoryIndex())
    ks = keys(3)
    idx.add(ks, A, GPU)
    idx.lookup(ks)
    idx.remove(ks[:1], A)
    text = generate_latest(idx.registry).decode()
    assert 'kvmesh_router_index_keys_total{op="add"} 3.0' in text
    assert 'kvmesh_router_index_keys_total{op="lookup"} 3.0' in text
    assert 'kvmesh_router_index_ops_total{op="remove"} 1.0' in text
    assert "kvmesh_router_index_lookup_seconds_count 1.0" in text


def test_two_redis_indexes_share_state(redis_url):
    prefix = f"shared{uuid.uuid4().hex[:8]}:"
    one, two = RedisIndex(redis_url, key_prefix=prefix), RedisIndex(redis_url, key_prefix=prefix)
    ks = keys(3)
    one.add(ks, A, GPU)
    assert two.lookup(ks) == [{A: GPU}] * 3
    two.clear_pod(A)
    assert one.lookup(ks) == []
    one.close()
    two.close()


def test_redis_ttl_expires_entries(redis_url):
    idx = RedisIndex(redis_url, key_prefix=f"ttl{uuid.uuid4().hex[:8]}:", ttl_s=0.05)
    ks = keys(2)
    idx.add(ks, A, GPU)
    client = redis.Redis.from_url(redis_url)
    ttl = client.pttl(idx.prefix + b"b:" + ks[0])
    assert 0 < ttl <= 50
    client.close()
    idx.close()


def test_redis_unreachable_is_a_typed_error():
    idx = RedisIndex(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(TierUnavailableError):
        idx.lookup(keys(1))
    with pytest.raises(TierUnavailableError):
        idx.add(keys(1), A, GPU)
    idx.close()


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove", "clear"]),
        st.lists(st.integers(0, 7), min_size=1, max_size=5),
        st.sampled_from([A, B, C]),
        st.integers(1, 15),
    ),
    max_size=40,
)


def _check_against_model(index, ops) -> None:
    """Random operation sequences agree with a dict-of-dicts reference model."""
    universe = keys(8, tag="p")
    model: dict[BlockKey, dict[PodId, int]] = {}
    for op, idxs, pod, media in ops:
        ks = [universe[i] for i in idxs]
        if op == "add":
            index.add(ks, pod, MediumSet(media))
            for k in ks:
                model.setdefault(k, {})[pod] = model.get(k, {}).get(pod, 0) | media
        elif op == "remove":
            index.remove(ks, pod, MediumSet(media))
            for k in ks:
                holders = model.get(k, {})
                if pod in holders:
                    left = holders[pod] & ~media
                    if left:
                        holders[pod] = left
                    else:
                        del holders[pod]
                if not holders:
                    model.pop(k, None)
        else:
            index.clear_pod(pod)
            for k in list(model):
                model[k].pop(pod, None)
                if not model[k]:
                    del model[k]
        for k in universe:
            assert index.lookup([k]) == ([model[k]] if k in model else [])
    expected = []
    for k in universe:
        if k not in model:
            break
        expected.append(model[k])
    assert index.lookup(universe) == expected


@settings(max_examples=150, deadline=None)
@given(_OPS)
def test_memory_index_matches_reference_model(ops):
    _check_against_model(InMemoryIndex(100), ops)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_redis_index_matches_reference_model(redis_url, ops):
    idx = RedisIndex(redis_url, key_prefix=f"h{uuid.uuid4().hex[:10]}:")
    try:
        _check_against_model(idx, ops)
    finally:
        idx.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_write_behind_redis_index_matches_reference_model(redis_url, ops):
    idx = RedisIndex(redis_url, key_prefix=f"w{uuid.uuid4().hex[:10]}:")
    writer = WriteBehindIndex(idx)
    writer.start()
    try:
        _check_against_model(writer, ops)
    finally:
        writer.close()
        idx.close()
