"""Blocks in the fleet's shared tier: announced by one pod, loadable by every endpoint."""

from __future__ import annotations

import pytest

from kvmesh.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.core.hashing import BlockHasher, Namespace
from kvmesh.core.types import Medium, PodId
from kvmesh.router.index import SHARED_TIER_HOLDER, InMemoryIndex
from kvmesh.router.ingest import EventApplier
from kvmesh.router.plugins.scorers import ApproximatePrefixScorer, PrecisePrefixScorer
from kvmesh.router.plugins.ttft_estimate import TTFTEstimateScorer
from kvmesh.router.prefix import match_prefix
from kvmesh.router.types import EndpointState, PrefixMatch, RoutingRequest

MODEL = "m"
A, B, C = PodId("http://a:1"), PodId("http://b:1"), PodId("http://c:1")
TOKENS = list(range(1000, 1000 + 16 * 8))
SHARED = Medium.SHARED.value


def make(per_pod: int = 10_000) -> tuple[InMemoryIndex, EventApplier]:
    idx = InMemoryIndex(10_000)
    return idx, EventApplier(idx, model=MODEL, max_blocks_per_pod=per_pod)


def match(idx: InMemoryIndex, tokens: list[int] = TOKENS) -> PrefixMatch:
    return match_prefix(idx, BlockHasher(Namespace(MODEL), 16), tokens)


def test_a_shared_write_is_loadable_by_every_endpoint():
    idx, ap = make()
    ap.apply(A, BlockStored([1, 2], None, TOKENS[:32], 16))  # A computed two blocks
    ap.apply(A, BlockStored([1, 2, 3, 4], None, TOKENS[:64], 16, medium=SHARED))  # and wrote four
    m = match(idx)
    assert m.shared is not None and m.shared.num_blocks == 4
    assert SHARED_TIER_HOLDER not in m.pods  # the shared tier is no endpoint
    # A finds two blocks on its device and loads the next two; C, which announced nothing, all four
    assert m.pods[A].num_blocks == 4 and m.pods[A].blocks_by_tier == {Medium.GPU: 2, Medium.SHARED: 2}
    assert m.match_of(C) is m.shared and m.hit_tokens(C) == 64
    # A pod holding more on its device than the shared tier keeps its own match
    ap.apply(B, BlockStored([1, 2, 3, 4, 5, 6], None, TOKENS[:96], 16))
    assert match(idx).pods[B].blocks_by_tier == {Medium.GPU: 6}


def test_shared_blocks_outlive_the_device_copy_and_leave_on_their_own_removal():
    idx, ap = make()
    ap.apply(A, BlockStored([1, 2, 3], None, TOKENS[:48], 16))
    ap.apply(A, BlockStored([1, 2, 3], None, TOKENS[:48], 16, medium=SHARED))
    ap.apply(A, BlockRemoved([1, 2, 3], medium="GPU"))  # evicted from A's device
    ap.apply(A, AllBlocksCleared())
    m = match(idx)
    assert m.pods == {} and m.shared is not None and m.shared.num_blocks == 3
    # Any pod may report the shared tier's removals (kvmesh engines agree on block hashes), and
    # a store's tier name ("REDIS") is the shared medium too
    ap.apply(B, BlockRemoved([3], medium="REDIS"))
    m = match(idx)
    assert m.shared is not None and m.shared.num_blocks == 2
    ap.apply(A, BlockRemoved([3], medium=SHARED))
    assert ap.stats.num_unknown_hashes == 1


def test_a_shared_announcement_without_tokens_names_the_publisher_blocks():
    idx, ap = make()
    ap.apply(A, BlockStored([1, 2, 3], None, TOKENS[:48], 16))
    ap.apply(A, BlockStored([1, 2, 99], None, [], 16, medium=SHARED))  # 99: never announced
    assert ap.stats.num_unknown_hashes == 1
    m = match(idx)
    assert m.shared is not None and m.shared.num_blocks == 2
    assert m.hit_tokens(B) == 32


def test_the_shared_tier_counts_from_the_start_of_the_prompt():
    idx, ap = make()
    ap.apply(A, BlockStored([1, 2], None, TOKENS[:32], 16))
    ap.apply(A, BlockStored([3, 4], 2, TOKENS[32:64], 16, medium=SHARED))  # parent: A's device block
    assert ap.stats.num_orphans == 0
    # A store serves prefixes (its lookup stops at the first chunk it lacks), so blocks 2-3 help
    # nobody while blocks 0-1 are only on A's device
    m = match(idx)
    assert m.shared is None and m.pods[A].blocks_by_tier == {Medium.GPU: 2}
    ap.apply(A, BlockStored([1, 2], None, TOKENS[:32], 16, medium=SHARED))
    m = match(idx)
    assert m.shared is not None and m.shared.num_blocks == 4 and m.hit_tokens(B) == 64


def test_the_shared_tier_map_is_bounded_like_a_pod():
    idx, ap = make(per_pod=3)
    ap.apply(A, BlockStored([1, 2, 3, 4, 5], None, TOKENS[:80], 16, medium=SHARED))
    assert ap.num_blocks(SHARED_TIER_HOLDER) == 3
    assert match(idx).shared is None  # the oldest (first) blocks left: no run from the start


def test_scorers_credit_the_shared_tier_to_every_endpoint():
    request = RoutingRequest("r", TOKENS, Namespace(MODEL))
    idx, ap = make()
    ap.apply(A, BlockStored(list(range(1, 9)), None, TOKENS, 16))
    ap.apply(A, BlockStored([1, 2, 3, 4], None, TOKENS[:64], 16, medium=SHARED))
    request.prefix = match(idx)
    a, b = EndpointState(A), EndpointState(B)
    precise = PrecisePrefixScorer({Medium.GPU: 1.0, Medium.SHARED: 0.5})
    assert precise.score(request, [a, b]) == [1.0, pytest.approx(0.5 * 4 / 8)]
    ttft = TTFTEstimateScorer(1000.0, 0.0, 1e6, {Medium.SHARED: 1.0})
    # B loads 64 tokens (64 MB at 1 GB/s) and computes the other 64
    assert ttft.estimate(request, b) == pytest.approx(64 * 1e6 / 1e9 + 0.064)
    busy = EndpointState(A, pending_prefill_tokens=1000)
    assert ttft.score(request, [busy, b])[1] == 1.0  # a queue on the holder sends it where it loads
    # the routing history scores what no endpoint's own cache holds; the shared tier does not
    # count (every endpoint could load it, at a price): the prefix goes back where it went before
    history = ApproximatePrefixScorer(block_size=16, capacity=100, beyond_cache=True)
    shared_only = RoutingRequest("s", TOKENS, Namespace(MODEL))
    shared_only.prefix = PrefixMatch(8, 16, shared=request.prefix.shared)
    assert shared_only.prefix.longest_blocks() == 4 and shared_only.prefix.longest_own_blocks() == 0
    history.observe(RoutingRequest("h", TOKENS, Namespace(MODEL), prefix=PrefixMatch(8, 16)), B)
    assert history.score(shared_only, [a, b]) == [0.0, 1.0]
    assert request.prefix.longest_own_blocks() == 8
    assert history.score(request, [a, b]) == [0.0, 0.0]  # A's own cache holds it whole


def test_kv_cache_groups_are_each_publisher_own_in_a_mixed_fleet():
    """A vLLM pod tags its events with KV cache groups, a kvmesh engine does not: each publisher's
    shared-tier announcements pass its own group check, and neither hides the other's."""
    idx, ap = make()
    other = list(range(5000, 5000 + 16 * 4))
    tagged = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    ap.apply(A, BlockStored([11, 12, 13, 14], None, other, 16, medium=SHARED, **tagged))
    ap.apply(B, BlockStored([1, 2, 3, 4, 5, 6], None, TOKENS[:96], 16, medium=SHARED))  # untagged
    sliding = {"group_idx": 1, "kv_cache_spec_kind": "sliding_window"}
    ap.apply(A, BlockStored([21, 22], None, other[:32], 16, medium=SHARED, **sliding))
    ap.apply(B, BlockStored([7], 6, TOKENS[96:112], 16, medium=SHARED))
    assert ap.stats.num_skipped_groups == 1  # A's sliding-window group only
    first, second = match(idx), match(idx, other)
    assert first.shared is not None and first.shared.num_blocks == 7
    assert second.shared is not None and second.shared.num_blocks == 4
    ap.apply(A, BlockRemoved([14], medium=SHARED, group_idx=0))
    second = match(idx, other)
    assert second.shared is not None and second.shared.num_blocks == 3


def test_publishers_with_their_own_hashes_share_one_entry_per_block():
    """vLLM pods seeded apart name the same blocks with different hashes: the shared tier keeps the
    block while any announcement of it stands."""
    idx, ap = make()
    ap.apply(A, BlockStored([1, 2, 3, 4], None, TOKENS[:64], 16, medium=SHARED))
    ap.apply(B, BlockStored([91, 92, 93, 94], None, TOKENS[:64], 16, medium=SHARED))
    ap.apply(A, BlockRemoved([3, 4], medium=SHARED))
    m = match(idx)
    assert m.shared is not None and m.shared.num_blocks == 4  # B's announcement still stands
    ap.apply(B, BlockRemoved([94], medium=SHARED))
    m = match(idx)
    assert m.shared is not None and m.shared.num_blocks == 3


def test_the_shared_tier_forgets_the_least_recently_announced_blocks_first():
    idx, ap = make(per_pod=8)
    hot, cold = TOKENS[:64], list(range(7000, 7064))
    ap.apply(A, BlockStored([1, 2, 3, 4], None, hot, 16, medium=SHARED))
    ap.apply(B, BlockStored([11, 12, 13, 14], None, cold, 16, medium=SHARED))
    ap.apply(A, BlockStored([1, 2, 3, 4], None, hot, 16, medium=SHARED))  # written again: hot
    ap.apply(B, BlockStored([21, 22], None, list(range(8000, 8032)), 16, medium=SHARED))  # 10 > 8
    hot_match, cold_match = match(idx, hot), match(idx, cold)
    assert hot_match.shared is not None and hot_match.shared.num_blocks == 4
    assert cold_match.shared is None  # its first blocks went first
