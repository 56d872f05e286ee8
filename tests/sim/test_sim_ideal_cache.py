"""The ideal shared cache: exact LRU prefix hits, checked against a list model and by its inclusion property."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.types import BlockKey
from kvmesh.sim.ideal_cache import IdealSharedCache

BS = 4


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "big"))


def prompt(chain: list[int], tail: int) -> tuple[list[BlockKey], int]:
    """Keys named by ``chain`` (already prefix-unique) and the prompt length with ``tail`` extra tokens."""
    return [key(c) for c in chain], len(chain) * BS + tail


def model_hits(requests: list[tuple[list[BlockKey], int]], capacity_blocks: int) -> list[int]:
    lru: list[BlockKey] = []  # least recent first
    hits = []
    for keys, n in requests:
        limit = min(len(keys), max(n - 1, 0) // BS)
        m = 0
        while m < limit and keys[m] in lru:
            m += 1
        hits.append(m * BS)
        for k in reversed(keys):
            if k in lru:
                lru.remove(k)
            lru.append(k)
            if len(lru) > capacity_blocks:
                lru.pop(0)
    return hits


# A request is a walk down a small tree of prefixes: block i's key names the whole path to it,
# as chained keys do, so equal keys always mean equal prefixes.
paths = st.lists(st.integers(0, 2), min_size=0, max_size=6)
requests_st = st.lists(st.tuples(paths, st.integers(0, BS)), min_size=1, max_size=30)


def to_requests(raw: list[tuple[list[int], int]]) -> list[tuple[list[BlockKey], int]]:
    out = []
    for path, tail in raw:
        chain = [int("1" + "".join(map(str, path[: i + 1])), 4) for i in range(len(path))]
        out.append(prompt(chain, tail))
    return out


@settings(max_examples=200, deadline=None)
@given(raw=requests_st, capacity_blocks=st.integers(1, 12))
def test_hits_equal_a_list_lru_model(raw, capacity_blocks):
    requests = to_requests(raw)
    cache = IdealSharedCache(capacity_blocks * BS, BS)
    assert [cache.observe(k, n) for k, n in requests] == model_hits(requests, capacity_blocks)
    assert len(cache) <= capacity_blocks
    res = cache.result()
    assert res.prompt_tokens == sum(n for _, n in requests)
    assert res.num_requests == len(requests)


@settings(max_examples=150, deadline=None)
@given(raw=requests_st, small=st.integers(1, 10), extra=st.integers(1, 10))
def test_a_larger_cache_never_serves_less(raw, small, extra):
    requests = to_requests(raw)
    a, b = IdealSharedCache(small * BS, BS), IdealSharedCache((small + extra) * BS, BS)
    for keys, n in requests:
        assert a.observe(keys, n) <= b.observe(keys, n)
        assert all(k in b for k in a._last)  # LRU inclusion: the small cache is a subset


def test_exact_scenario_heads_outlive_tails_and_the_last_token_is_computed():
    cache = IdealSharedCache(3 * BS, BS)
    keys, n = prompt([1, 2, 3], 0)
    assert cache.observe(keys, n) == 0
    assert cache.observe(keys, n) == 2 * BS  # 12 tokens: the last block holds the last token
    longer, n4 = prompt([1, 2, 3, 4], 1)
    assert cache.observe(longer, n4) == 3 * BS
    # four blocks touched tail first into three slots: the head survives, block 4 is gone
    assert [k in cache for k in longer] == [True, True, True, False]
    other, m = prompt([9], 3)
    cache.observe(other, m)
    assert [k in cache for k in longer] == [True, True, False, False]
    assert cache.result().hit_rate == pytest.approx((2 * BS + 3 * BS) / (12 + 12 + 17 + 7))


def test_capacity_below_one_block_is_refused():
    with pytest.raises(ValueError, match="one block"):
        IdealSharedCache(BS - 1, BS)
