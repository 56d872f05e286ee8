"""Device-tier prefix cache: exact blocks, eviction order, pinning and the events it emits."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvmesh.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.core.hashing import BlockHasher, Namespace
from kvmesh.core.types import Medium
from kvmesh.engine.prefix_cache import PrefixCache, engine_block_hash, prefix_stored_event

BS = 4


def make_cache(capacity_blocks: int, keep_kv: bool = False) -> PrefixCache:
    return PrefixCache(capacity_blocks * BS, BS, BlockHasher(Namespace("m"), BS), keep_kv=keep_kv)


def run(cache: PrefixCache, rid: str, tokens: list[int], tenant: str = "", kv: np.ndarray | None = None):
    """Admit, compute and cache a prompt the way the scheduler does; returns the allocation."""
    keys = cache.block_keys(tokens, tenant)
    hit = cache.match(keys)
    alloc = cache.allocate(rid, keys, hit, len(keys) - hit)
    assert alloc is not None
    cache.cache_blocks(alloc, keys, tokens, kv, kv_start=hit * BS if kv is not None else 0, tenant=tenant)
    return alloc, keys, hit


def test_stores_blocks_and_publishes_one_chain_event() -> None:
    cache = make_cache(8)
    alloc, keys, hit = run(cache, "a", list(range(10)))
    assert hit == 0 and len(keys) == 2
    assert alloc.keys == keys and alloc.num_reserved == 0
    [event] = cache.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [engine_block_hash(k) for k in keys]
    assert event.parent_block_hash is None
    assert event.token_ids == list(range(8))
    assert event.block_size == BS and event.medium == "GPU" and event.extra_keys is None
    assert cache.take_events() == []
    assert engine_block_hash(keys[0]) == int.from_bytes(keys[0][:8], "big")


def test_reuse_pins_shared_prefix_and_event_names_parent() -> None:
    cache = make_cache(8)
    a, keys_a, _ = run(cache, "a", list(range(8)))
    cache.take_events()
    b, keys_b, hit = run(cache, "b", [*range(8), 100, 101, 102, 103])
    assert hit == 2 and keys_b[:2] == keys_a
    [event] = cache.take_events()
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash == engine_block_hash(keys_a[1])
    assert event.token_ids == [100, 101, 102, 103]
    assert cache.num_cached_blocks == 3
    assert cache.num_used_blocks == 3
    cache.free(a)
    assert cache.num_used_blocks == 3  # b still pins the shared blocks
    cache.free(b)
    assert cache.num_used_blocks == 0 and cache.num_free_blocks == 3
    assert cache.usage == 0.0


def test_lru_evicts_least_recently_freed_tail_first() -> None:
    cache = make_cache(4)
    a, keys_a, _ = run(cache, "a", list(range(8)))  # blocks a0 a1
    cache.free(a)
    b, keys_b, _ = run(cache, "b", list(range(50, 58)))  # blocks b0 b1
    cache.free(b)
    cache.take_events()
    # One new block needs room for one: a's tail (a1) goes first, not a's head.
    c, keys_c, _ = run(cache, "c", list(range(90, 94)))
    removed = [h for e in cache.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [engine_block_hash(keys_a[1])]
    assert cache.match(keys_a) == 1
    # Three more: a0, then b's tail b1, then b0 (c0 is pinned and stays).
    d, keys_d, _ = run(cache, "d", list(range(200, 212)))
    removed = [h for e in cache.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [engine_block_hash(k) for k in (keys_a[0], keys_b[1], keys_b[0])]
    assert cache.cached_keys() == {*keys_c, *keys_d}
    assert cache.num_evicted == 4
    del c, d


def test_pinned_blocks_are_never_evicted_and_allocation_fails_instead() -> None:
    cache = make_cache(3)
    a, keys_a, _ = run(cache, "a", list(range(12)))
    assert cache.usage == 1.0
    keys = cache.block_keys(list(range(40, 44)))
    assert cache.allocate("b", keys, 0, 1) is None
    assert cache.match(keys_a) == 3
    assert not any(isinstance(e, BlockRemoved) for e in cache.take_events())
    cache.free(a)
    assert cache.allocate("b", keys, 0, 1) is not None


def test_cache_blocks_without_reservation_evicts_or_stops() -> None:
    cache = make_cache(2)
    keys = cache.block_keys(list(range(12)))
    alloc = cache.allocate("a", keys, 0, 1)
    assert alloc is not None
    added = cache.cache_blocks(alloc, keys, list(range(12)))
    assert added == 2  # one reserved, one from the spare block; the third does not fit
    assert cache.num_cached_blocks == 2 and cache.match(keys) == 2


def test_tenants_get_separate_chains_and_extra_keys() -> None:
    cache = make_cache(8)
    tokens = list(range(8))
    run(cache, "a", tokens, tenant="acme")
    [event] = cache.take_events()
    assert isinstance(event, BlockStored)
    assert event.extra_keys == [["acme"], None]
    assert cache.match(cache.block_keys(tokens)) == 0
    assert cache.match(cache.block_keys(tokens, "other")) == 0
    assert cache.match(cache.block_keys(tokens, "acme")) == 2


def test_kv_is_kept_per_block_and_concatenated_back() -> None:
    cache = make_cache(8, keep_kv=True)
    kv = np.arange(2 * 2 * 1 * 8 * 3, dtype=np.float32).reshape(2, 2, 1, 8, 3)
    alloc, keys, _ = run(cache, "a", list(range(8)), kv=kv)
    np.testing.assert_array_equal(cache.get_kv(keys), kv)
    np.testing.assert_array_equal(cache.get_kv(keys[:1]), kv[:, :, :, :4])
    assert cache.get_kv([]) is None
    cache.free(alloc)


def test_reset_refused_while_pinned_then_clears() -> None:
    cache = make_cache(4)
    a, keys, _ = run(cache, "a", list(range(8)))
    assert cache.reset() is False
    cache.free(a)
    cache.take_events()
    assert cache.reset() is True
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.match(keys) == 0


def test_grow_and_double_free() -> None:
    cache = make_cache(2)
    alloc = cache.allocate("a", [], 0, 1)
    assert alloc is not None
    assert cache.grow(alloc, 1) is True
    assert cache.grow(alloc, 1) is False
    cache.free(alloc)
    cache.free(alloc)
    assert cache.num_reserved == 0


def test_shrink_returns_reserved_blocks() -> None:
    cache = make_cache(3)
    alloc = cache.allocate("a", [], 0, 3)
    assert alloc is not None and cache.can_allocate(1) is False
    cache.shrink(alloc, 2)
    assert (alloc.num_reserved, cache.num_reserved, cache.can_allocate(2)) == (1, 1, True)
    with pytest.raises(ValueError, match="cannot shrink"):
        cache.shrink(alloc, 2)
    cache.free(alloc)
    assert cache.num_reserved == 0


def test_capacity_must_hold_a_block() -> None:
    with pytest.raises(ValueError, match="less than one block"):
        PrefixCache(3, 4)


def test_simulated_constructor_keeps_no_kv() -> None:
    cache = PrefixCache.create_simulated(64, 16)
    tokens = list(range(32))
    keys = cache.block_keys(tokens)
    alloc = cache.allocate("a", keys, 0, 2)
    assert alloc is not None
    cache.cache_blocks(alloc, keys, tokens, np.zeros((1, 2, 1, 32, 1), np.float32))
    assert cache.get_kv(keys) is None and cache.match(keys) == 2


@pytest.mark.parametrize("tenant", ["", "acme"])
def test_prefix_stored_event_matches_the_device_event_of_a_root_chain(tenant: str) -> None:
    cache = make_cache(8)
    tokens = list(range(14))
    _, keys, _ = run(cache, "a", tokens, tenant)
    [device] = cache.take_events()
    shared = prefix_stored_event(keys, tokens, BS, tenant, Medium.SHARED)
    assert shared == msgspec.structs.replace(device, medium="SHARED")
    with pytest.raises(ValueError, match="need 12 tokens, got 11"):
        prefix_stored_event(keys, tokens[:11], BS, tenant, Medium.SHARED)
