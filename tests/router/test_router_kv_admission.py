"""The TTFT estimate's KV term: the wait for free KV and the recompute of what a copy evicts."""

from __future__ import annotations

import random

import pytest

from kvmesh.core.hashing import Namespace
from kvmesh.core.types import Medium, PodId
from kvmesh.router.index import InMemoryIndex
from kvmesh.router.plugins.kv_admission import KVAdmissionPrice
from kvmesh.router.plugins.ttft_estimate import TTFTEstimateScorer
from kvmesh.router.scheduler import Scheduler, load_scheduler_config
from kvmesh.router.types import EndpointState, PodMatch, PrefixMatch, RoutingRequest

HOLDER, OTHER = PodId("http://holder:1"), PodId("http://other:1")
PROMPT = list(range(1000, 1000 + 16 * 64))  # 1,024 tokens, 64 blocks of 16


def session_turn(held_blocks: int) -> RoutingRequest:
    r = RoutingRequest("r", PROMPT, Namespace("m"))
    r.prefix = PrefixMatch(64, 16, {HOLDER: PodMatch(held_blocks, {Medium.GPU: held_blocks})})
    return r


def scorer(price: KVAdmissionPrice) -> TTFTEstimateScorer:
    return TTFTEstimateScorer(1000.0, 0.0, 0.0, {}, kv_price=price)


def test_a_prompt_that_does_not_fit_the_free_kv_waits_for_running_requests_to_release_it():
    price = KVAdmissionPrice(turnover_s=8.0)
    full = EndpointState(OTHER, kv_capacity_tokens=4096, kv_cache_usage=0.9)  # 409.6 tokens free
    assert price.seconds(full, 1024, 1024, 0.001) == pytest.approx((1024 - 409.6) / 4096 * 8.0)
    assert (
        price.seconds(EndpointState(OTHER, kv_capacity_tokens=4096, kv_cache_usage=0.5), 1024, 1024, 0.001)
        == 0.0
    )
    # a prompt larger than the whole KV waits for all of it, not longer
    assert (
        price.seconds(EndpointState(OTHER, kv_capacity_tokens=512, kv_cache_usage=1.0), 1024, 0, 0.0) == 8.0
    )
    # an engine that does not report its capacity is priced as before
    assert price.seconds(EndpointState(OTHER, kv_cache_usage=1.0), 1024, 1024, 0.001) == 0.0


def test_new_tokens_are_priced_with_the_recompute_of_what_they_evict():
    price = KVAdmissionPrice(evict_weight=0.5)
    empty = EndpointState(OTHER, kv_capacity_tokens=100_000)
    assert price.seconds(empty, 1024, 1000, 0.002) == pytest.approx(0.5 * 1000 * 0.002)
    assert price.seconds(empty, 1024, 0, 0.002) == 0.0


def test_a_busy_holder_keeps_its_session_when_the_copy_waits_for_kv_and_evicts():
    # the holder has 960 of 1,024 tokens and 1,100 tokens of prefill ahead; the other endpoint is idle
    # in compute but its KV is held by running requests
    r = session_turn(held_blocks=60)
    holder = EndpointState(HOLDER, pending_prefill_tokens=1100, kv_capacity_tokens=8192, kv_cache_usage=0.2)
    other = EndpointState(OTHER, kv_capacity_tokens=8192, kv_cache_usage=0.95)
    compute_only = scorer(KVAdmissionPrice())
    assert compute_only.score(r, [holder, other]) == [pytest.approx(1.024 / 1.164), 1.0]  # moves
    with_kv = scorer(KVAdmissionPrice(turnover_s=8.0, evict_weight=0.5))
    scores = with_kv.score(r, [holder, other])
    # other: 1.024 s compute + 0.6 s for KV + 0.512 s evicted; holder: 1.164 + 0.032 s
    assert scores == [1.0, pytest.approx(1.196 / 2.136)]  # stays


def test_a_prefix_loaded_from_a_lower_tier_takes_device_kv_as_a_recompute_does():
    # the prompt's first 960 tokens on OTHER: in its device tier, its CPU tier or the shared tier
    def on(medium: Medium) -> RoutingRequest:
        r = RoutingRequest("r", PROMPT, Namespace("m"))
        r.prefix = PrefixMatch(64, 16, {OTHER: PodMatch(60, {medium: 60})})
        return r

    est = TTFTEstimateScorer(
        1000.0, 0.0, 0.0, {Medium.CPU: 16.0, Medium.SHARED: 10.0}, kv_price=KVAdmissionPrice(evict_weight=0.5)
    )
    other = EndpointState(OTHER, kv_capacity_tokens=100_000)
    compute = 64 * 0.001  # the 64 tokens no tier holds
    assert est.estimate(on(Medium.GPU), other) == pytest.approx(compute + 0.5 * 64 * 0.001)
    # loaded (no KV bytes given: no transfer time), the 960 tokens push as many cached tokens out of
    # the device tier as computed ones would
    for medium in (Medium.CPU, Medium.SHARED):
        assert est.estimate(on(medium), other) == pytest.approx(compute + 0.5 * 1024 * 0.001)


def test_the_default_profile_prices_what_a_copy_evicts_and_the_wait_for_free_kv():
    config = load_scheduler_config("precise")
    s = Scheduler.from_config(config, index=InMemoryIndex(capacity=None), rng=random.Random(0))
    ttft = next(w.scorer for w in s.profiles["default"].scorers if isinstance(w.scorer, TTFTEstimateScorer))
    assert ttft.kv_price == KVAdmissionPrice(
        turnover_s=0.0, evict_weight=0.5, learned_wait=True, session_weight=3.0
    )
    config["plugins"][0]["parameters"]["kvTurnoverSeconds"] = 8
    config["plugins"][0]["parameters"]["kvWaitLearned"] = True
    s = Scheduler.from_config(config, index=InMemoryIndex(capacity=None), rng=random.Random(0))
    ttft = next(w.scorer for w in s.profiles["default"].scorers if isinstance(w.scorer, TTFTEstimateScorer))
    assert ttft.kv_price.turnover_s == 8.0
    assert ttft.kv_price.learned_wait


def test_a_new_session_is_priced_with_the_overflow_of_the_live_sessions_held_there():
    price = KVAdmissionPrice(session_weight=3.0)
    crowded = EndpointState(OTHER, kv_capacity_tokens=8192, session_kv_tokens=7700)
    roomy = EndpointState(OTHER, kv_capacity_tokens=8192, session_kv_tokens=2000)
    # 1,024 new tokens beside 7,700 held: 532 overflow, priced as 3x their recompute
    assert price.seconds(crowded, 1024, 1024, 0.001) == pytest.approx(3.0 * 532 * 0.001)
    assert price.seconds(roomy, 1024, 1024, 0.001) == 0.0
    # the overflow counts at most the prompt itself
    full = EndpointState(OTHER, kv_capacity_tokens=8192, session_kv_tokens=20_000)
    assert price.seconds(full, 1024, 1024, 0.001) == pytest.approx(3.0 * 1024 * 0.001)
    # the session's own holder is not priced for it: it is one of the sessions held there
    assert price.seconds(crowded, 1024, 64, 0.001) == 0.0


def test_a_new_session_goes_where_the_live_sessions_leave_kv_for_it():
    r = RoutingRequest("r", PROMPT, Namespace("m"))
    r.prefix = PrefixMatch(64, 16)
    # the crowded endpoint is idle right now (its sessions are between turns); the other is busier
    crowded = EndpointState(HOLDER, kv_capacity_tokens=8192, session_kv_tokens=8000)
    busier = EndpointState(OTHER, pending_prefill_tokens=300, kv_capacity_tokens=8192, session_kv_tokens=1000)
    assert scorer(KVAdmissionPrice()).score(r, [crowded, busier]) == [1.0, pytest.approx(1024 / 1324)]
    priced = scorer(KVAdmissionPrice(session_weight=3.0)).score(r, [crowded, busier])
    assert priced[1] == 1.0 and priced[0] < 1.0


def test_a_short_prompt_waits_its_shortfall_at_the_learned_release_rate():
    price = KVAdmissionPrice(turnover_s=8.0, learned_wait=True)
    full = EndpointState(OTHER, kv_capacity_tokens=4096, kv_cache_usage=0.9, kv_release_tokens_per_s=200.0)
    assert price.seconds(full, 1024, 0, 0.001) == pytest.approx((1024 - 409.6) / 200.0)
    # prompts this router sent there that have not started take their KV first
    full.pending_kv_tokens = 1000
    assert price.seconds(full, 1024, 0, 0.001) == pytest.approx((2024 - 409.6) / 200.0)
    # no rate learned yet: the configured turnover
    unknown = EndpointState(OTHER, kv_capacity_tokens=4096, kv_cache_usage=0.9)
    assert price.seconds(unknown, 1024, 0, 0.001) == pytest.approx((1024 - 409.6) / 4096 * 8.0)
    # the learned rate is used only when asked for
    assert KVAdmissionPrice(turnover_s=8.0).seconds(full, 1024, 0, 0.001) == pytest.approx(
        (2024 - 409.6) / 4096 * 8.0
    )


def test_a_holder_that_frees_kv_slowly_loses_the_session_to_one_that_frees_it_fast():
    # both endpoints' KV is held by running requests; the holder's decodes free it at 100 tokens/s
    r = session_turn(held_blocks=32)
    holder = EndpointState(HOLDER, kv_capacity_tokens=8192, kv_cache_usage=1.0, kv_release_tokens_per_s=100.0)
    other = EndpointState(OTHER, kv_capacity_tokens=8192, kv_cache_usage=1.0, kv_release_tokens_per_s=5000.0)
    learned = scorer(KVAdmissionPrice(learned_wait=True))
    # holder: 0.512 s compute + 10.24 s for KV; other: 1.024 s + 0.205 s
    assert learned.score(r, [holder, other]) == [pytest.approx(1.2288 / 10.752), 1.0]
    # with the rates unknown both wait nothing, and the holder's cached half wins
    holder.kv_release_tokens_per_s = other.kv_release_tokens_per_s = 0.0
    assert learned.score(r, [holder, other]) == [1.0, pytest.approx(0.5)]


def test_a_queued_endpoint_prices_a_copys_recompute_and_keeps_the_session_at_its_holder():
    # the holder has 960 of 1,024 tokens behind 1,500 tokens of prefill. Priced alone, a copy on
    # the other endpoint wins (1.024 s against 1.5 + 0.064 s). The 960 tokens it recomputes there
    # also delay the requests that reach that endpoint while its backlog drains: once per request
    # queued there. An idle endpoint still takes the copy; a queued one does not.
    r = session_turn(held_blocks=60)
    plain = TTFTEstimateScorer(1000.0, 0.0, 0.0, {})
    priced = TTFTEstimateScorer(1000.0, 0.0, 0.0, {}, queue_weight=1.0)

    def pool(other_queue: int) -> list[EndpointState]:
        return [
            EndpointState(HOLDER, pending_prefill_tokens=1500, pending_prefills=3),
            EndpointState(OTHER, pending_prefills=other_queue),
        ]

    assert plain.score(r, pool(2)) == pytest.approx([1.024 / 1.564, 1.0])
    # the holder's queue does not price its own (least) work: an idle other endpoint takes the copy
    assert priced.score(r, pool(0)) == pytest.approx(plain.score(r, pool(0)))
    # two requests queued there: the copy costs 1.024 + 2 x 0.96 s, the holder 1.564 s
    assert priced.score(r, pool(2)) == pytest.approx([1.0, 1.564 / (1.024 + 2 * 0.96)])


def test_a_cold_prompt_needs_the_same_work_everywhere_and_pays_no_queue_price():
    r = RoutingRequest("r", PROMPT, Namespace("m"))
    r.prefix = PrefixMatch(64, 16, {})
    plain = TTFTEstimateScorer(1000.0, 0.0, 0.0, {})
    priced = TTFTEstimateScorer(1000.0, 0.0, 0.0, {}, queue_weight=8.0)
    pool = [
        EndpointState(HOLDER, pending_prefill_tokens=1500, pending_prefills=4),
        EndpointState(OTHER, pending_prefills=2),
    ]
    assert priced.score(r, pool) == pytest.approx(plain.score(r, pool))
    assert priced.score(r, pool) == pytest.approx([1.024 / 2.524, 1.0])
