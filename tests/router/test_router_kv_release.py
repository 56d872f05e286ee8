"""Each endpoint's KV release rate, learned from the requests seen to end there."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.core.types import PodId
from kvmesh.router.kv_release import KVReleaseRates
from kvmesh.router.prefill_ledger import PrefillLedger
from kvmesh.router.types import EndpointState

POD = PodId("http://a:1")


def test_a_steady_stream_of_releases_is_measured_at_its_rate():
    rates = KVReleaseRates(horizon_s=30.0)
    state = EndpointState(POD)
    rates.watch(state, 0.0)
    for i in range(1, 601):  # 2,000 tokens every 0.5 s for five minutes: 4,000 tokens/s
        rates.released(state, 2000, i * 0.5)
    assert state.kv_release_tokens_per_s == pytest.approx(4000.0, rel=0.03)


def test_an_endpoint_watched_briefly_is_not_divided_by_the_whole_horizon():
    rates = KVReleaseRates(horizon_s=30.0)
    state = EndpointState(POD)
    rates.watch(state, 10.0)
    rates.released(state, 1000, 12.0)  # one request in the first two seconds
    assert state.kv_release_tokens_per_s == pytest.approx(1000.0 / (30.0 * -math.expm1(-2 / 30.0)))
    assert 490.0 < state.kv_release_tokens_per_s < 530.0
    # a release right after the first counts over a second, not over a microsecond
    other = EndpointState(PodId("http://b:1"))
    rates.watch(other, 0.0)
    rates.released(other, 1000, 1e-6)
    assert 1000.0 <= other.kv_release_tokens_per_s < 1020.0


def test_an_endpoint_where_nothing_ends_drifts_to_zero():
    rates = KVReleaseRates(horizon_s=10.0)
    state = EndpointState(POD)
    rates.watch(state, 0.0)
    for i in range(1, 101):
        rates.released(state, 500, i * 0.1)
    busy = state.kv_release_tokens_per_s
    rates.refresh(60.0)  # fifty seconds without an end
    assert state.kv_release_tokens_per_s < busy * math.exp(-4.9)


def test_a_re_added_endpoint_starts_over():
    rates = KVReleaseRates()
    old = EndpointState(POD)
    rates.watch(old, 0.0)
    rates.released(old, 10_000, 1.0)
    assert old.kv_release_tokens_per_s > 9000.0
    new = EndpointState(POD)
    rates.watch(new, 2.0)
    assert new.kv_release_tokens_per_s == 0.0
    rates.released(new, 100, 3.0)
    assert 0.0 < new.kv_release_tokens_per_s < 200.0


@given(st.lists(st.tuples(st.integers(0, 10**6), st.floats(0.0, 100.0)), max_size=50))
def test_the_rate_is_never_negative_or_infinite(events):
    rates = KVReleaseRates(horizon_s=5.0)
    state = EndpointState(POD)
    now = 0.0
    for tokens, dt in events:
        now += dt
        rates.released(state, tokens, now)
        assert 0.0 <= state.kv_release_tokens_per_s < math.inf


def test_the_horizon_must_be_positive():
    with pytest.raises(ValueError, match="horizon"):
        KVReleaseRates(horizon_s=0.0)


def test_the_ledger_publishes_the_kv_of_prompts_not_yet_started_and_learns_releases():
    ledger = PrefillLedger(learn=False)
    state = EndpointState(POD)
    ledger.sent("a", state, 300, 0.0, cached=700)
    ledger.sent("b", state, 50, 0.0, cached=0)
    assert state.pending_kv_tokens == 1050
    ledger.first_token("a", 1.0)
    assert state.pending_kv_tokens == 50
    ledger.finished("b")
    assert state.pending_kv_tokens == 0
    ledger.released("a", state, 1000, 2.0)
    ledger.released("b", state, 1000, 3.0)
    assert state.kv_release_tokens_per_s > 0.0
