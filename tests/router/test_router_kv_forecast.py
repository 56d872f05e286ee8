"""The release forecast: when each endpoint's running answers give their KV back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.core.types import PodId
from kvmesh.router.kv_forecast import MIN_SAMPLES, DecodeDurations, EndpointReleases, KVReleaseForecast
from kvmesh.router.plugins.kv_admission import KVAdmissionPrice
from kvmesh.router.prefill_ledger import PrefillLedger
from kvmesh.router.types import EndpointState

POD = PodId("http://a:1")


def durations_of(samples: list[float]) -> DecodeDurations:
    d = DecodeDurations()
    for s in samples:
        d.add(s)
    return d


def test_an_answer_is_expected_to_run_the_mean_of_the_longer_answers_less_its_age():
    d = durations_of([float(s) for s in range(1, 101)])
    assert d.remaining(0.0) == pytest.approx(50.5)
    assert d.remaining(50.0) == pytest.approx(75.5 - 50.0)
    # heavy tails: an answer that has run long is expected to run longer still
    tail = durations_of([1.0] * 90 + [100.0] * 10)
    assert tail.remaining(0.5) == pytest.approx(10.9 - 0.5)
    assert tail.remaining(2.0) == pytest.approx(98.0)
    # past every sample it is taken to run as long again
    assert d.remaining(250.0) == 250.0


@given(st.lists(st.floats(0.0, 1e4), min_size=1, max_size=60), st.floats(0.0, 1.2e4))
def test_the_expected_rest_is_the_mean_excess_of_the_samples(samples, age):
    d = durations_of(samples)
    longer = [s for s in samples if s > age]
    expected = sum(longer) / len(longer) - age if longer else age
    assert d.remaining(age) == pytest.approx(expected, rel=1e-9, abs=1e-6)
    assert d.remaining(age) >= 0.0


def test_the_sample_keeps_only_the_last_answers():
    d = DecodeDurations(capacity=MIN_SAMPLES)
    for _ in range(MIN_SAMPLES):
        d.add(100.0)
    for _ in range(MIN_SAMPLES):
        d.add(1.0)
    assert len(d) == MIN_SAMPLES
    assert d.remaining(0.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="capacity"):
        DecodeDurations(capacity=MIN_SAMPLES - 1)


def schedule_of(state: EndpointState) -> list[tuple[float, int]]:
    releases = state.kv_releases
    assert isinstance(releases, EndpointReleases)
    return releases.schedule()


def test_the_forecast_lists_running_answers_in_release_order_once_durations_are_known():
    forecast = KVReleaseForecast(durations_of([10.0] * (MIN_SAMPLES - 1)))
    state = EndpointState(POD)
    forecast.started(state, "old", 90_000, 0.0)
    forecast.started(state, "young", 30_000, 8.0)
    forecast.refresh(9.0)
    assert schedule_of(state) == []  # too few answers seen to end
    forecast.durations.add(10.0)
    assert schedule_of(state) == [(pytest.approx(1.0), 90_000), (pytest.approx(9.0), 30_000)]
    forecast.ended(state, "old", 10.0)
    forecast.refresh(10.0)
    assert schedule_of(state) == [(pytest.approx(8.0), 30_000)]
    assert len(forecast.durations) == MIN_SAMPLES + 1
    forecast.ended(state, "never-started", 10.0)  # ignored
    assert len(forecast.durations) == MIN_SAMPLES + 1


def test_the_wait_is_until_enough_answers_have_released():
    forecast = KVReleaseForecast(durations_of([40.0] * MIN_SAMPLES))
    state = EndpointState(POD)
    for name, tokens, since in (("a", 20_000, 39.0), ("b", 50_000, 36.0), ("c", 90_000, 10.0)):
        forecast.started(state, name, tokens, since)
    forecast.refresh(40.0)  # 40 s answers: c ends in 10 s, b in 36, a in 39
    releases = state.kv_releases
    assert releases is not None
    assert releases.wait(10_000, 0.0) == pytest.approx(10.0)
    assert releases.wait(100_000, 0.0) == pytest.approx(36.0)
    assert releases.wait(160_000, 0.0) == pytest.approx(39.0)
    assert releases.wait(200_000, 0.0) is None  # more than they hold, and no rate known
    assert releases.wait(200_000, 10_000) == pytest.approx(39.0 + 4.0)


def test_the_price_waits_for_the_forecast_release_not_the_mean_rate():
    price = KVAdmissionPrice(learned_wait=True)
    durations = durations_of([1.0] * (MIN_SAMPLES // 2) + [60.0] * (MIN_SAMPLES // 2))
    forecast = KVReleaseForecast(durations)
    # both engines free 20k tokens/s on average and hold 270k of 300k tokens; one is running
    # answers that just started, the other one answer that has run for 50 s (a long one)
    soon = EndpointState(PodId("http://soon:1"), kv_capacity_tokens=300_000, kv_cache_usage=0.9)
    late = EndpointState(PodId("http://late:1"), kv_capacity_tokens=300_000, kv_cache_usage=0.9)
    soon.kv_release_tokens_per_s = late.kv_release_tokens_per_s = 20_000
    forecast.started(soon, "s", 270_000, 50.0)
    forecast.started(late, "l", 270_000, 0.0)
    forecast.refresh(50.0)
    # 100k tokens needed, 30k free: 70k short
    assert price.seconds(soon, 100_000, 0, 0.0) == pytest.approx(30.5)  # the mean of 1 and 60 s
    assert price.seconds(late, 100_000, 0, 0.0) == pytest.approx(10.0)  # 60 s less the 50 run
    # a price left without the wait (a shared prefix) and one with no forecast (the mean rate)
    assert price.seconds(late, 100_000, 0, 0.0, wait=False) == 0.0
    late.kv_releases = None
    assert price.seconds(late, 100_000, 0, 0.0) == pytest.approx(70_000 / 20_000)


def test_the_ledger_times_answers_from_first_token_to_end():
    ledger = PrefillLedger(learn=False)
    state = EndpointState(POD)
    for i in range(MIN_SAMPLES):
        ledger.sent(f"r{i}", state, 1000, float(i), cached=0)
        ledger.first_token(f"r{i}", i + 0.5)
        ledger.released(f"r{i}", state, 1000, i + 2.5)  # 2 s answers
    ledger.sent("now", state, 4000, 100.0, cached=6000)
    ledger.first_token("now", 101.0)
    ledger.refresh(101.5)
    assert schedule_of(state) == [(pytest.approx(1.5), 10_000)]
    # a request that failed before its first token never runs
    ledger.sent("lost", state, 10, 102.0)
    ledger.finished("lost")
    ledger.released("lost", state, 10, 102.5)
    ledger.refresh(102.5)
    assert [t for _, t in schedule_of(state)] == [10_000]


def test_running_prompts_that_share_blocks_release_and_need_only_what_they_hold_alone():
    forecast = KVReleaseForecast(durations_of([10.0] * MIN_SAMPLES))
    # ten chats of 10k tokens on one 8k system prompt: 28k held of 32k, 100k counted
    shared = EndpointState(POD, kv_capacity_tokens=32_000, kv_cache_usage=0.875)
    for i in range(10):
        forecast.started(shared, f"chat{i}", 10_000, 0.0)
    forecast.refresh(1.0)
    releases = shared.kv_releases
    assert releases is not None
    assert releases.held_ratio() == pytest.approx(0.28)
    assert [t for _, t in schedule_of(shared)] == [2800] * 10
    price = KVAdmissionPrice(learned_wait=True)
    # a new chat with 9k cached (the held system prompt) and 1k new fits the 4k free; the same
    # prompt where the running prompts share nothing does not
    assert price.seconds(shared, 10_000, 1000, 0.0) == 0.0
    for i in range(10):
        forecast.ended(shared, f"chat{i}", 2.0)
        forecast.started(shared, f"own{i}", 2800, 2.0)
    assert releases.held_ratio() == 1.0
    assert price.seconds(shared, 10_000, 1000, 0.0) > 0.0
    # sessions that hold their own histories: the ratio stays 1 and a cached idle turn is retaken
    own = EndpointState(POD, kv_capacity_tokens=300_000, kv_cache_usage=0.6)
    forecast = KVReleaseForecast(durations_of([10.0] * MIN_SAMPLES))
    forecast.started(own, "a", 90_000, 0.0)
    forecast.started(own, "b", 90_000, 0.0)
    forecast.refresh(1.0)
    assert price.seconds(own, 130_000, 1000, 0.0) == pytest.approx(9.0)  # 10k short: both answers end


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 10**6)), max_size=60))
def test_the_held_sum_follows_the_running_answers(steps):
    forecast = KVReleaseForecast(durations_of([1.0] * MIN_SAMPLES))
    state = EndpointState(POD)
    for i, (start, rid, tokens) in enumerate(steps):
        if start:
            forecast.started(state, f"r{rid}", tokens, float(i))
        else:
            forecast.ended(state, f"r{rid}", float(i))
    releases = state.kv_releases
    if releases is not None:
        assert isinstance(releases, EndpointReleases)
        assert releases.held == sum(r.tokens for r in releases.running.values())
