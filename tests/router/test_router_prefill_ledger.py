"""The router's prefill ledger: outstanding work per endpoint and the pool's learned speed."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.core.hashing import Namespace
from kvmesh.errors import ConfigError
from kvmesh.router.index import InMemoryIndex
from kvmesh.router.metrics import EndpointLoadCollector
from kvmesh.router.plugins.registry import prefill_ledger_of
from kvmesh.router.plugins.ttft_estimate import TTFTEstimateScorer
from kvmesh.router.prefill_ledger import PrefillLedger
from kvmesh.router.prefill_speed import (
    DEFAULT_MAX_CONTEXT_RATIO,
    MIN_SAMPLE_WEIGHT,
    PrefillSpeedFit,
    prefill_pairs,
    prefill_work,
    work_of,
)
from kvmesh.router.scheduler import Scheduler, load_scheduler_config
from kvmesh.router.types import EndpointState, RoutingRequest

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


# --- the attention context, learned with the speed -------------------------------------------------


def ratio_of_sums(samples: list[tuple[float, float]], decay: float = 0.98) -> float:
    """The speed as it was before the attention context was learned: Σt / Σw over samples of 1024+."""
    weight = tokens = seconds = 0.0
    for work, t in samples:
        if work >= 1024 and t > 0:
            weight, tokens, seconds = weight * decay + 1, tokens * decay + work, seconds * decay + t
    return 0.0 if weight < MIN_SAMPLE_WEIGHT else seconds / tokens


def feed(
    fit: PrefillSpeedFit,
    rng: random.Random,
    spt: float,
    context: float,
    num: int,
    *,
    cached_max: int = 100_000,
) -> None:
    """``num`` samples of prompts of 1k-40k tokens, half of them after a cached prefix of up to
    ``cached_max`` tokens, prefilled at ``spt`` seconds per token with attention doubling at ``context``."""
    for _ in range(num):
        start = rng.randrange(cached_max) if cached_max and rng.random() < 0.5 else 0
        end = start + rng.randrange(1024, 40_000)
        pairs = prefill_pairs(start, end)
        fit.add(
            work_of(end - start, pairs, fit.attention_context),
            spt * work_of(end - start, pairs, context),
            pairs,
        )


@given(
    st.floats(1e-5, 1e-3),
    st.floats(1 / 3.5, 3.5),
    st.integers(0, 2**32 - 1),
)
def test_the_attention_context_is_learned_from_prompts_of_varied_lengths_and_positions(
    spt, truth_ratio, seed
):
    prior = 30_000.0
    truth = prior * truth_ratio
    fit = PrefillSpeedFit(attention_context=prior)
    feed(fit, random.Random(seed), spt, truth, 300)
    learned_spt, learned_context = fit.estimate()
    assert learned_context == pytest.approx(truth, rel=0.03)
    assert learned_spt == pytest.approx(spt, rel=0.03)


def test_prompts_of_one_length_leave_the_attention_context_at_its_prior():
    rng = random.Random(7)
    fit = PrefillSpeedFit(attention_context=30_000.0)
    for _ in range(200):  # cold 8k prompts whose attention costs twice the prior's: no way to tell
        pairs = prefill_pairs(0, 8192)
        fit.add(
            work_of(8192, pairs, 30_000.0),
            1e-4 * work_of(8192, pairs, 15_000.0) * rng.uniform(0.8, 1.2),
            pairs,
        )
    learned_spt, learned_context = fit.estimate()
    assert learned_context == pytest.approx(30_000.0)
    assert learned_spt > 0


def test_noisy_prompts_of_little_spread_barely_move_the_attention_context():
    # 2k-4k cold prompts with 20 % noise: attention is 3-7 % of their work, too little to measure
    rng = random.Random(3)
    fit = PrefillSpeedFit(attention_context=30_000.0)
    for _ in range(500):
        n = rng.randrange(2000, 4000)
        pairs = prefill_pairs(0, n)
        fit.add(work_of(n, pairs, 30_000.0), 1e-4 * work_of(n, pairs, 30_000.0) * rng.gauss(1.0, 0.2), pairs)
        learned = fit.attention_context_tokens()
        assert learned == 0.0 or 25_000.0 <= learned <= 36_000.0


def test_late_first_tokens_do_not_move_the_attention_context():
    # one first token in four waits 2-20x its prefill (KV, other routers' prompts): the typical
    # samples still teach the truth, and the speed keeps the waits
    rng = random.Random(11)
    fit = PrefillSpeedFit(attention_context=60_000.0)
    clean = PrefillSpeedFit(attention_context=60_000.0)
    for _ in range(400):
        start = rng.randrange(80_000) if rng.random() < 0.5 else 0
        end = start + rng.randrange(1024, 30_000)
        pairs = prefill_pairs(start, end)
        seconds = 1e-4 * work_of(end - start, pairs, 20_000.0)
        late = rng.random() < 0.25
        fit.add(work_of(end - start, pairs, 60_000.0), seconds * (rng.uniform(2, 20) if late else 1.0), pairs)
        clean.add(work_of(end - start, pairs, 60_000.0), seconds, pairs)
    assert fit.attention_context_tokens() == pytest.approx(20_000.0, rel=0.05)
    assert fit.seconds_per_token() > 1.5 * clean.seconds_per_token()


@given(
    st.lists(
        st.tuples(st.integers(0, 200_000), st.integers(1, 100_000), st.floats(1e-3, 100.0)),
        min_size=1,
        max_size=80,
    ),
    st.floats(1.0, 8.0),
)
def test_any_samples_keep_the_attention_context_within_its_bounds(samples, ratio):
    prior = 30_000.0
    fit = PrefillSpeedFit(attention_context=prior, max_context_ratio=ratio)
    for start, n, seconds in samples:
        pairs = prefill_pairs(start, start + n)
        fit.add(work_of(n, pairs, prior), seconds, pairs)
    learned_spt, learned_context = fit.estimate()
    if fit.weight < MIN_SAMPLE_WEIGHT:
        assert (learned_spt, learned_context) == (0.0, 0.0)
    else:  # the context once enough samples look alike
        assert learned_context == 0.0 or prior / ratio * (1 - 1e-9) <= learned_context <= prior * ratio * (
            1 + 1e-9
        )
        assert 0.0 < learned_spt < math.inf


@given(
    st.lists(st.tuples(st.integers(0, 100_000), st.integers(1, 60_000), st.floats(1e-3, 100.0)), max_size=60),
    st.sampled_from([(0.0, True), (30_000.0, False)]),
)
def test_without_a_prior_or_its_learning_the_speed_is_the_ratio_of_sums_as_before(samples, setting):
    context, learn = setting
    fit = PrefillSpeedFit(attention_context=context, learn_context=learn)
    works = []
    for start, n, seconds in samples:
        work = prefill_work(start, start + n, context)
        fit.add(work, seconds, prefill_pairs(start, start + n))
        works.append((work, seconds))
    assert fit.estimate() == (ratio_of_sums(works), 0.0)  # bit for bit


def test_a_ledger_without_context_learning_matches_one_with_the_context_fixed():
    # the same traffic through a ledger that learns nothing of the context and one with no prior
    # to learn from: both publish 0 as the learned context and the same speeds and backlogs as the
    # ledger always did
    rng = random.Random(5)
    ledgers = [
        PrefillLedger(min_tokens=100, attention_context=2000.0, learn_context=False),
        PrefillLedger(min_tokens=100),
    ]
    states = [[EndpointState(A), EndpointState(B)] for _ in ledgers]
    for i in range(200):
        now = i * 0.5
        pick, n, cached = rng.randrange(2), rng.randrange(100, 3000), rng.choice([0, 0, rng.randrange(5000)])
        for ledger, (a, b) in zip(ledgers, states, strict=True):
            ledger.refresh(now)
            ledger.sent(f"r{i}", (a, b)[pick], n, now, cached=cached)
            if i >= 3:
                ledger.first_token(f"r{i - 3}", now + 0.1)
    for ledger, (a, b) in zip(ledgers, states, strict=True):
        assert ledger.seconds_per_token > 0 and ledger.attention_context_tokens == 0.0
        assert a.attention_context_tokens == b.attention_context_tokens == 0.0


def test_the_learned_attention_context_is_published_and_reprices_the_backlog():
    ledger = PrefillLedger(min_tokens=100, attention_context=1000.0)
    a, b = EndpointState(A), EndpointState(B)
    ledger.sent("long", b, 3000, now=0.0)  # open while the context is learned: 3000 + 4500 at the prior
    assert b.pending_prefill_tokens == 7500
    rng = random.Random(2)
    for i in range(80):  # attention costs a quarter of the prior's: C = 4000
        n, cached = rng.randrange(200, 3000), rng.choice([0, rng.randrange(4000)])
        ledger.sent(f"r{i}", a, n, now=10.0 * i, cached=cached)
        ledger.first_token(f"r{i}", now=10.0 * i + 1e-4 * prefill_work(cached, cached + n, 4000.0))
    assert ledger.attention_context_tokens == pytest.approx(4000.0, rel=0.02)
    assert ledger.seconds_per_token == pytest.approx(1e-4, rel=0.02)
    assert a.attention_context_tokens == b.attention_context_tokens == ledger.attention_context_tokens
    assert a.seconds_per_prefill_token == b.seconds_per_prefill_token == ledger.seconds_per_token
    assert b.pending_prefill_tokens == pytest.approx(
        3000 + 4.5e6 / 4000.0, abs=20
    )  # nothing drained: no refresh
    ledger.first_token("long", now=1000.0)
    assert b.pending_prefill_tokens == 0
    c = EndpointState("http://c")
    ledger.sent("new", c, 1000, now=1000.0, cached=1000)  # an endpoint joining later gets the learned values
    assert c.attention_context_tokens == ledger.attention_context_tokens
    assert c.pending_prefill_tokens == pytest.approx(1000 + 1.5e6 / ledger.attention_context_tokens, abs=1)


def test_max_context_ratio_must_be_at_least_one():
    with pytest.raises(ValueError, match="max_context_ratio"):
        PrefillLedger(attention_context=1000.0, max_context_ratio=0.5)


def test_the_ttft_estimate_prices_own_tokens_at_the_learned_attention_context():
    # 128 cold tokens: 128 + 128**2 / (2 * C) tokens at position 0, at 1 ms each
    scorer = TTFTEstimateScorer(1000.0, 0.0, 0.0, {}, attention_context=128.0, max_context_ratio=4.0)
    request = RoutingRequest("r", list(range(128)), Namespace("m"))
    assert scorer.estimate(request, EndpointState(A)) == pytest.approx(0.192)  # not learned: the prior
    assert scorer.estimate(request, EndpointState(A, attention_context_tokens=256.0)) == pytest.approx(0.160)
    assert scorer.estimate(request, EndpointState(A, attention_context_tokens=1e6)) == pytest.approx(
        0.144
    )  # 4x
    assert scorer.estimate(request, EndpointState(A, attention_context_tokens=1.0)) == pytest.approx(
        0.384
    )  # /4
    plain = TTFTEstimateScorer(1000.0, 0.0, 0.0, {})
    assert plain.estimate(request, EndpointState(A, attention_context_tokens=256.0)) == pytest.approx(0.128)


def test_the_ledger_learns_as_the_ttft_scorer_of_its_config_says():
    config = load_scheduler_config("precise")
    params = config["plugins"][0]["parameters"]
    ledger = prefill_ledger_of(config)
    assert ledger.attention_context == 30_000.0 and ledger._fit.learns_context
    assert ledger._fit.max_context_ratio == DEFAULT_MAX_CONTEXT_RATIO
    params.update(learnAttentionContext=False, maxLearnedContextRatio=2)
    ledger = prefill_ledger_of(config)
    assert not ledger._fit.learns_context and ledger._fit.max_context_ratio == 2.0
    Scheduler.from_config(config, index=InMemoryIndex(capacity=None))  # the scorer takes both
    params["maxLearnedContextRatio"] = 0.5
    with pytest.raises(ConfigError, match="maxLearnedContextRatio"):
        prefill_ledger_of(config)
    assert prefill_ledger_of(load_scheduler_config("load")).attention_context == 0.0  # no TTFT scorer


def test_the_learned_speed_and_attention_context_are_exported():
    states = [
        EndpointState(A, seconds_per_prefill_token=1e-4, attention_context_tokens=25_000.0),
        EndpointState(B),
    ]
    metrics = {m.name: m for m in EndpointLoadCollector(lambda: states).collect()}
    assert metrics["kvmesh_router_prefill_tokens_per_second"].samples[0].value == pytest.approx(10_000.0)
    assert metrics["kvmesh_router_attention_context_tokens"].samples[0].value == 25_000.0


def test_pending_prefills_count_the_requests_without_a_first_token():
    ledger = PrefillLedger()
    a, b = EndpointState(A), EndpointState(B)
    ledger.sent("r1", a, 1000, now=0.0)
    ledger.sent("r2", a, 0, now=0.0, cached=500)  # a full hit still waits for its first token
    ledger.sent("r3", b, 200, now=0.0)
    assert (a.pending_prefills, b.pending_prefills) == (2, 1)
    ledger.sent("r3", a, 200, now=0.1)  # retried on a: moves
    assert (a.pending_prefills, b.pending_prefills) == (3, 0)
    ledger.first_token("r1", now=1.0)
    ledger.finished("r2")
    ledger.finished("r2")
    assert a.pending_prefills == 1
