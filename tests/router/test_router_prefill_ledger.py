"""The router's prefill ledger: outstanding work per endpoint and the pool's learned speed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.router.prefill_ledger import MIN_SAMPLE_WEIGHT, PrefillLedger, PrefillSpeedFit, prefill_work
from kvmesh.router.types import EndpointState

A, B = "http://a", "http://b"


def test_pending_tokens_follow_sends_first_tokens_and_failures():
    ledger = PrefillLedger()
    a, b = EndpointState(A), EndpointState(B)
    ledger.sent("r1", a, 1000, now=0.0)
    ledger.sent("r2", a, 500, now=0.1)
    ledger.sent("r3", b, 200, now=0.1)
    assert (a.pending_prefill_tokens, b.pending_prefill_tokens) == (1500, 200)
    ledger.first_token("r1", now=1.0)
    assert a.pending_prefill_tokens == 500
    ledger.finished("r2")  # failed before its first token
    ledger.finished("r2")  # and the stream's end is reported again: no double release
    ledger.first_token("r3", now=0.5)
    assert (a.pending_prefill_tokens, b.pending_prefill_tokens) == (0, 0)
    assert len(ledger) == 0


def test_work_is_weighted_by_position_with_an_attention_context():
    assert prefill_work(0, 1000, 0.0) == 1000.0
    assert prefill_work(0, 1000, 1000.0) == pytest.approx(1500.0)  # positions 0..1000 average 1.5x
    assert prefill_work(1000, 2000, 1000.0) == pytest.approx(2500.0)  # the same tokens after a prefix
    ledger = PrefillLedger(attention_context=1000.0)
    a = EndpointState(A)
    ledger.sent("cold", a, 2000, now=0.0)
    ledger.sent("suffix", a, 1000, now=0.0, cached=1000)
    assert a.pending_prefill_tokens == 4000 + 2500
    ledger.first_token("cold", now=1.0)
    assert a.pending_prefill_tokens == 2500
    with pytest.raises(ValueError):
        PrefillLedger(attention_context=-1.0)


def test_a_long_prompt_keeps_its_endpoint_busy_for_its_attention_work():
    # the speed learned on short prompts drains a long prompt's work no faster than it is done
    plain, weighted = PrefillLedger(min_tokens=100), PrefillLedger(min_tokens=100, attention_context=1000.0)
    a, b = EndpointState(A), EndpointState(B)
    for ledger, state in ((plain, a), (weighted, b)):
        for i in range(int(MIN_SAMPLE_WEIGHT) + 8):
            ledger.sent(f"r{i}", state, 200, now=10.0 * i)
            ledger.first_token(f"r{i}", now=10.0 * i + 0.2)
        ledger.refresh(1000.0)  # before each decision, as the router does
        ledger.sent("long", state, 4000, now=1000.0)
        ledger.refresh(1004.0)
    assert a.pending_prefill_tokens == 0  # 4000 tokens at 1 ms each: drained after 4 s
    assert b.pending_prefill_tokens > 0  # 12000 units of work at 0.2 s per 220: about 7 s left


def test_a_retry_on_another_endpoint_moves_the_work():
    ledger = PrefillLedger()
    a, b = EndpointState(A), EndpointState(B)
    ledger.sent("r1", a, 800, now=0.0)
    ledger.sent("r1", b, 900, now=0.2)  # A refused the connection; the gateway tries B
    assert (a.pending_prefill_tokens, b.pending_prefill_tokens) == (0, 900)


def test_speed_is_learned_from_first_tokens_and_shared_by_the_pool():
    ledger = PrefillLedger(min_tokens=100)
    a, b = EndpointState(A), EndpointState(B)
    ledger.sent("warm", b, 0, now=0.0)  # b is known to the ledger before any sample
    for i in range(int(MIN_SAMPLE_WEIGHT) + 8):
        ledger.sent(f"r{i}", a, 2000, now=10.0 * i)
        ledger.first_token(f"r{i}", now=10.0 * i + 0.5)  # 2000 tokens in 0.5 s
    assert a.seconds_per_prefill_token == pytest.approx(0.5 / 2000)
    assert b.seconds_per_prefill_token == a.seconds_per_prefill_token


def test_work_ahead_counts_in_a_sample():
    ledger = PrefillLedger(min_tokens=100)
    a = EndpointState(A)
    for i in range(int(MIN_SAMPLE_WEIGHT) + 8):
        ledger.sent(f"x{i}", a, 3000, now=10.0 * i)
        ledger.sent(f"y{i}", a, 1000, now=10.0 * i)
        ledger.first_token(f"x{i}", now=10.0 * i + 0.3)
        ledger.first_token(f"y{i}", now=10.0 * i + 0.4)  # waited behind x: 4000 tokens of work
    assert a.seconds_per_prefill_token == pytest.approx((0.3 + 0.4) / (3000 + 4000))


def test_small_prefills_and_learning_off_teach_nothing():
    quiet = PrefillLedger(learn=False)
    small = PrefillLedger(min_tokens=1024)
    a, b = EndpointState(A), EndpointState(B)
    for i in range(50):
        quiet.sent(f"r{i}", a, 5000, now=float(i))
        quiet.first_token(f"r{i}", now=i + 0.5)
        small.sent(f"r{i}", b, 64, now=float(i))
        small.first_token(f"r{i}", now=i + 0.5)
    assert a.seconds_per_prefill_token == 0.0 and b.seconds_per_prefill_token == 0.0


@given(st.lists(st.tuples(st.integers(1024, 100_000), st.floats(1e-3, 100.0)), min_size=1, max_size=60))
def test_fit_is_a_weighted_ratio_within_the_samples_range(samples):
    fit = PrefillSpeedFit()
    for tokens, seconds in samples:
        fit.add(tokens, seconds)
    learned = fit.seconds_per_token()
    if fit.weight < MIN_SAMPLE_WEIGHT:
        assert learned == 0.0
    else:
        ratios = [s / t for t, s in samples]
        assert min(ratios) * (1 - 1e-9) <= learned <= max(ratios) * (1 + 1e-9)


def test_decay_must_be_a_fraction():
    with pytest.raises(ValueError, match="decay"):
        PrefillLedger(decay=0.0)


def test_refresh_drains_the_backlog_at_the_learned_speed_but_never_below_zero():
    ledger = PrefillLedger(min_tokens=100)
    a, b = EndpointState(A), EndpointState(B)
    for i in range(int(MIN_SAMPLE_WEIGHT) + 8):  # learn 1000 tokens/s
        ledger.sent(f"w{i}", b, 1000, now=10.0 * i)
        ledger.first_token(f"w{i}", now=10.0 * i + 1.0)
    t = 1000.0
    ledger.refresh(t)
    ledger.sent("big", a, 4000, now=t)
    ledger.refresh(t + 1.5)  # 1.5 s at 1000 tokens/s: 1500 of 4000 done
    assert a.pending_prefill_tokens == 2500
    ledger.sent("next", a, 1000, now=t + 1.5)
    assert a.pending_prefill_tokens == 3500
    ledger.refresh(t + 100.0)
    assert a.pending_prefill_tokens == 0
    ledger.first_token("big", now=t + 100.0)  # releasing open work never goes negative
    assert a.pending_prefill_tokens == 0
    assert len(ledger) == 1


def test_without_a_learned_speed_nothing_drains():
    ledger = PrefillLedger()
    a = EndpointState(A)
    ledger.sent("r", a, 4000, now=0.0)
    ledger.refresh(100.0)
    assert a.pending_prefill_tokens == 4000
