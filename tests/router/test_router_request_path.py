"""The per-request fast paths give exactly what the plain computations give.

Each test compares a path shortened for router CPU with a plain reference written out here: the
headers passed to an endpoint, the weighted totals of the default preset's five scorers, the KV
release rates aged in one loop, usage objects read from dicts, and text prints taken when a cache
note opens rather than when it is settled.
"""

from __future__ import annotations

import math
import random
from types import MappingProxyType
from typing import Any

from aiohttp.test_utils import make_mocked_request
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from kvmesh.core.cache_usage import CacheUsage
from kvmesh.core.hashing import Namespace
from kvmesh.core.types import PodId
from kvmesh.router.cache_explain import CacheReportConfig
from kvmesh.router.cache_report import CacheNote, CacheReporter
from kvmesh.router.gateway import forwarded_headers
from kvmesh.router.kv_release import KVReleaseRates
from kvmesh.router.scheduler import Scheduler, combine_scores, load_scheduler_config
from kvmesh.router.types import Decision, PrefixMatch, RoutingRequest

_NAMES = ["Authorization", "authorization", "X-Tenant-Id", "x-tenant-id", "X-Session-Id", "Accept", "Host"]
_PASSED = ("authorization", "x-tenant-id", "x-session-id")


@given(
    st.lists(st.tuples(st.sampled_from(_NAMES), st.text("abcXYZ0123 ", min_size=1, max_size=6)), max_size=8)
)
def test_forwarded_headers_are_the_last_value_of_each_passed_header_and_the_content_type(
    items: list[tuple[str, str]],
):
    request = make_mocked_request("POST", "/v1/completions", headers=CIMultiDict(items))
    expected: dict[str, str] = {}
    for name, value in items:  # the client's order: a repeated header's last value wins
        if name.lower() in _PASSED:
            expected[name.lower()] = value
    expected["content-type"] = "application/json"
    got = {k.lower(): v for k, v in forwarded_headers(request).items()}
    assert got == expected


def _totals_left_to_right(columns: list[list[float]], weights: list[float], n: int) -> list[float]:
    """Every total summed from 0.0 column by column, then divided once (the reference order)."""
    div = sum(weights) if sum(weights) > 0 else 1.0
    totals = [0.0] * n
    for column, weight in zip(columns, weights, strict=True):
        totals = [t + weight * s for t, s in zip(totals, column, strict=True)]
    return [t / div for t in totals]


_UNIT = st.floats(0.0, 1.0, allow_nan=False)


@given(
    st.integers(1, 6).flatmap(
        lambda arity: st.tuples(
            st.lists(st.lists(_UNIT, min_size=4, max_size=4), min_size=arity, max_size=arity),
            st.lists(st.floats(0.01, 5.0), min_size=arity, max_size=arity),
        )
    )
)
def test_combined_totals_are_bit_for_bit_the_left_to_right_sum_at_every_arity(
    case: tuple[list[list[float]], list[float]],
):
    columns, weights = case
    assert combine_scores(columns, weights, 4) == _totals_left_to_right(columns, weights, 4)


class _StepwiseRates:
    """KV release rates aged meter by meter, as :class:`KVReleaseRates` did before its loop."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self.meters: dict[str, list[float]] = {}  # pod -> [mass, at, since, rate]

    def released(self, pod: str, tokens: int, now: float) -> None:
        meter = self.meters.setdefault(pod, [0.0, now, now, 0.0])
        self._decay(meter, now)
        meter[0] += max(tokens, 0)
        self._publish(meter, now)

    def refresh(self, now: float) -> None:
        for meter in self.meters.values():
            self._decay(meter, now)
            self._publish(meter, now)

    def _decay(self, meter: list[float], now: float) -> None:
        dt = now - meter[1]
        if dt > 0:
            meter[0] *= math.exp(-dt / self.horizon_s)
            meter[1] = now

    def _publish(self, meter: list[float], now: float) -> None:
        watched = max(now - meter[2], min(1.0, self.horizon_s))
        meter[3] = meter[0] / (self.horizon_s * -math.expm1(-watched / self.horizon_s))


@settings(max_examples=60)
@given(
    st.floats(0.2, 120.0),
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 2), st.floats(0.0, 3.0), st.integers(0, 100_000)),
        max_size=40,
    ),
)
def test_kv_release_rates_aged_in_one_loop_match_the_stepwise_ageing(
    horizon_s: float, steps: list[tuple[bool, int, float, int]]
):
    from kvmesh.router.types import EndpointState

    rates, reference = KVReleaseRates(horizon_s), _StepwiseRates(horizon_s)
    states = [EndpointState(PodId(f"http://p{i}:1")) for i in range(3)]
    now = 0.0
    for is_release, i, dt, tokens in steps:
        now += dt
        if is_release:
            rates.released(states[i], tokens, now)
            reference.released(states[i].pod, tokens, now)
        else:
            rates.refresh(now)
            reference.refresh(now)
        for state in states:
            expected = reference.meters.get(state.pod, [0.0, 0.0, 0.0, 0.0])[3]
            assert state.kv_release_tokens_per_s == expected


_COUNT = st.integers(0, 10_000)


@given(
    st.fixed_dictionaries(
        {"prompt_tokens": _COUNT},
        optional={
            "prompt_tokens_details": st.one_of(
                st.none(), st.fixed_dictionaries({}, optional={"cached_tokens": st.one_of(_COUNT, st.none())})
            ),
            "input_tokens_details": st.fixed_dictionaries({"cached_tokens": _COUNT}),
            "input_tokens": _COUNT,
        },
    )
)
def test_usage_read_from_a_dict_equals_usage_read_from_any_mapping(usage: dict[str, Any]):
    def frozen(value: Any) -> Any:
        return (
            MappingProxyType({k: frozen(v) for k, v in value.items()}) if isinstance(value, dict) else value
        )

    assert CacheUsage.from_usage(usage) == CacheUsage.from_usage(frozen(usage))


def _reporter() -> CacheReporter:
    scheduler = Scheduler.from_config(load_scheduler_config("round-robin"), block_size=4)
    return CacheReporter(CacheReportConfig(), scheduler, lambda pod: None)


@settings(max_examples=40)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=25))
def test_prints_taken_when_the_note_opens_settle_it_as_prints_taken_at_the_end(
    requests: list[tuple[int, int, int]],
):
    """Two reporters see the same requests: one through ``begin``, one through a note opened by
    hand with nothing computed (as ``begin`` did before), which takes its prints when settled.
    Their headers and remembered prints agree."""
    early, late = _reporter(), _reporter()
    rng = random.Random(len(requests))
    texts = [
        "You are a careful assistant. " * 12 + f"Variant {v}. " + "Answer briefly. " * 10 for v in range(6)
    ]
    pod = PodId("http://a:1")
    usage = {"prompt_tokens_details": {"cached_tokens": 0}}
    for n, (variant, shift, blocks) in enumerate(requests):
        tokens = [rng.randrange(1000) if shift else i for i in range(blocks * 4 + 1)]
        headers = []
        for reporter in (early, late):
            routing = RoutingRequest(f"r{n}", tokens, Namespace("m", "", "", ""))
            routing.prefix = PrefixMatch(blocks, 4)
            decision = Decision(endpoint=pod, ranked=[pod], scores={pod: 1.0})
            if reporter is early:
                note = reporter.begin(f"id{n}", "", routing, decision, [texts[variant]])
            else:
                note = CacheNote(f"id{n}", "", routing, decision, [texts[variant]], 0.0, reporter.clock())
                note.prompt_tokens, note.prefix = routing.num_tokens, routing.prefix
            answered = CacheUsage.from_usage({**usage, "prompt_tokens": len(tokens)})
            headers.append(reporter.finish(note, pod, answered).header_value())
        assert headers[0] == headers[1]
    assert early.prints._first_keys == late.prints._first_keys
