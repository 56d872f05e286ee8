"""Scheduler, scorers, pickers, filters and YAML profiles; pure, in virtual time."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from kvmesh.core.hashing import BlockHasher, Namespace
from kvmesh.core.types import Medium, PodId
from kvmesh.errors import ConfigError
from kvmesh.router.index import InMemoryIndex, medium_set
from kvmesh.router.plugins.base import Params, PluginContext, PluginKind
from kvmesh.router.plugins.registry import (
    DEPRECATED_ALIASES,
    REGISTRY,
    Registration,
    attention_context_of,
    canonical_type,
)
from kvmesh.router.plugins.ttft_estimate import TTFTEstimateScorer
from kvmesh.router.scheduler import PRESET_NAMES, Scheduler, WeightedScorer, load_scheduler_config
from kvmesh.router.types import EndpointState, PodMatch, PrefixMatch, Role, RoutingRequest

NS = Namespace("m")
A, B, C = PodId("http://a:1"), PodId("http://b:1"), PodId("http://c:1")
TOKENS = list(range(5000, 5000 + 16 * 8))


def eps(*pods: PodId, **kw) -> list[EndpointState]:
    return [EndpointState(pod=p, **kw) for p in pods]


def req(
    i: int = 0, tokens: list[int] | None = None, session: str | None = None, tenant: str = ""
) -> RoutingRequest:
    return RoutingRequest(
        f"r{i}", TOKENS if tokens is None else tokens, NS.for_tenant(tenant), session_id=session
    )


def single(
    plugin_type: str, params: dict | None = None, weight: float = 1, picker: str = "max-score-picker"
) -> dict:
    return {
        "plugins": [{"type": plugin_type, "parameters": params or {}}, {"type": picker}],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": plugin_type, "weight": weight}, {"pluginRef": picker}],
            }
        ],
    }


def index_with(holdings: dict[PodId, tuple[int, Medium]]) -> InMemoryIndex:
    idx = InMemoryIndex()
    keys = BlockHasher(NS, 16).hash_blocks(TOKENS)
    for pod, (n, medium) in holdings.items():
        idx.add(keys[:n], pod, medium_set(medium))
    return idx


def test_presets_load_and_every_type_is_registered():
    for name in PRESET_NAMES:
        Scheduler.from_config(load_scheduler_config(name))
    for alias, target in DEPRECATED_ALIASES.items():
        assert canonical_type(alias) == target and target in REGISTRY


def test_precise_prefers_the_holder_and_weights_tiers():
    idx = index_with({A: (8, Medium.GPU), B: (4, Medium.GPU)})
    s = Scheduler.from_config(load_scheduler_config("precise"), index=idx, rng=random.Random(0))
    d = s.pick(req(), eps(A, B, C))
    assert d is not None and d.endpoint == A
    assert d.predicted_hit_tokens == 128
    assert d.ranked == [A, B, C]
    # the same 8 blocks on CPU (0.8) lose to 8 on GPU, but beat 6 on GPU (0.75)
    idx2 = index_with({A: (8, Medium.CPU), B: (6, Medium.GPU)})
    s2 = Scheduler.from_config(single("precise-prefix-cache-scorer"), index=idx2)
    scores = s2.pick(req(), eps(A, B)).scores  # type: ignore[union-attr]
    assert scores[A] == pytest.approx(0.8)
    assert scores[B] == pytest.approx(0.75)


def test_precise_tier_weights_are_configurable():
    idx = index_with({A: (8, Medium.SHARED)})
    s = Scheduler.from_config(
        single("precise-prefix-cache-scorer", {"tierWeights": {"SHARED": 0.25}}), index=idx
    )
    assert s.pick(req(), eps(A)).scores[A] == pytest.approx(0.25)  # type: ignore[union-attr]


def test_load_balances_against_prefix_under_precise_weights():
    idx = index_with({A: (8, Medium.GPU)})
    s = Scheduler.from_config(load_scheduler_config("precise"), index=idx, rng=random.Random(0))
    busy = [
        EndpointState(A, waiting=50, kv_cache_usage=0.95),
        EndpointState(B, waiting=0, kv_cache_usage=0.1),
    ]
    # prefix 3*1.0 vs (kv 2*0.85 + queue 2*1.0): the idle pod wins when the holder is swamped
    assert s.pick(req(), busy).endpoint == B  # type: ignore[union-attr]


def test_unhealthy_endpoints_are_skipped_and_none_when_empty():
    s = Scheduler.from_config(load_scheduler_config("random"), rng=random.Random(1))
    pool = eps(A, B)
    pool[0].healthy = False
    for i in range(20):
        assert s.pick(req(i), pool).endpoint == B  # type: ignore[union-attr]
    pool[1].healthy = False
    assert s.pick(req(), pool) is None


def test_round_robin_cycles_in_pod_order():
    s = Scheduler.from_config(load_scheduler_config("round-robin"))
    got = [s.pick(req(i), eps(C, A, B)).endpoint for i in range(6)]  # type: ignore[union-attr]
    assert got == [A, B, C, A, B, C]


def test_random_is_seeded_and_roughly_uniform():
    picks = [
        Scheduler.from_config(load_scheduler_config("random"), rng=random.Random(7))
        .pick(req(), eps(A, B, C))
        .endpoint  # type: ignore[union-attr]
        for _ in range(2)
    ]
    assert picks[0] == picks[1]
    s = Scheduler.from_config(load_scheduler_config("random"), rng=random.Random(3))
    counts = Counter(s.pick(req(i), eps(A, B, C)).endpoint for i in range(3000))  # type: ignore[union-attr]
    assert all(800 < counts[p] < 1200 for p in (A, B, C))


def test_max_score_ties_are_broken_at_random():
    s = Scheduler.from_config(single("queue-scorer"), rng=random.Random(5))
    counts = Counter(s.pick(req(i), eps(A, B)).endpoint for i in range(400))  # type: ignore[union-attr]
    assert counts[A] > 100 and counts[B] > 100


def test_queue_and_active_and_kv_scorers():
    s = Scheduler.from_config(single("queue-scorer"))
    d = s.pick(
        req(), [EndpointState(A, waiting=10), EndpointState(B, waiting=0), EndpointState(C, waiting=5)]
    )
    assert d is not None and d.ranked == [B, C, A]
    assert d.scores == {A: 0.0, B: 1.0, C: 0.5}
    s = Scheduler.from_config(single("active-request-scorer"))
    d = s.pick(req(), [EndpointState(A, in_flight=4), EndpointState(B, in_flight=1)])
    assert d is not None and d.scores == {A: 0.0, B: 0.75}
    s = Scheduler.from_config(single("kv-cache-scorer"))  # deprecated alias still works
    d = s.pick(req(), [EndpointState(A, kv_cache_usage=0.9), EndpointState(B, kv_cache_usage=0.2)])
    assert d is not None and d.endpoint == B and d.scores[A] == pytest.approx(0.1)


def test_session_affinity_sticks_to_first_choice():
    cfg = {
        "plugins": [{"type": "session-affinity-scorer"}, {"type": "round-robin-scorer"}],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "session-affinity-scorer", "weight": 10},
                    {"pluginRef": "round-robin-scorer", "weight": 1},
                ],
            }
        ],
    }
    s = Scheduler.from_config(cfg)
    first = s.pick(req(0, session="s1"), eps(A, B, C)).endpoint  # type: ignore[union-attr]
    others = {s.pick(req(i, session=None), eps(A, B, C)).endpoint for i in range(1, 4)}  # type: ignore[union-attr]
    assert len(others) == 3
    for i in range(5):
        assert s.pick(req(10 + i, session="s1"), eps(A, B, C)).endpoint == first  # type: ignore[union-attr]


def test_approximate_prefix_learns_from_its_own_decisions():
    s = Scheduler.from_config(load_scheduler_config("approximate"), rng=random.Random(2))
    first = s.pick(req(0), eps(A, B, C))
    assert first is not None
    for i in range(1, 6):
        d = s.pick(req(i, tokens=TOKENS + [i] * 70), eps(A, B, C))
        assert d is not None and d.endpoint == first.endpoint
        assert d.scores[first.endpoint] > d.scores[next(p for p in (A, B, C) if p != first.endpoint)]
    # a different tenant does not share the history
    scores = s.pick(req(99, tenant="other"), eps(A, B, C)).scores  # type: ignore[union-attr]
    assert scores[first.endpoint] < 0.99


def test_history_beyond_cache_scores_only_what_no_cache_holds():
    cfg = single("prefix-cache-scorer", {"blockSize": 16, "beyondCache": True})
    s = Scheduler.from_config(cfg)
    (scorer,) = [w.scorer for w in s.profiles["default"].scorers]
    scorer.observe(req(0), A)  # A was sent all 8 blocks of TOKENS
    r = req(1)
    r.prefix = PrefixMatch(8, 16, {})  # every cache lost them: A's history counts in full
    assert scorer.score(r, eps(A, B)) == [1.0, 0.0]
    r.prefix = PrefixMatch(8, 16, {B: PodMatch(6, {Medium.GPU: 6})})  # B still caches 6 of them
    assert scorer.score(r, eps(A, B)) == [pytest.approx(2 / 8), 0.0]
    r.prefix = PrefixMatch(8, 16, {B: PodMatch(8, {Medium.GPU: 8})})
    assert scorer.score(r, eps(A, B)) == [0.0, 0.0]
    scorer.observe(r, B)  # B's cache holds it whole: the index knows, the history records nothing
    lost = req(2)
    lost.prefix = PrefixMatch(8, 16, {})
    assert scorer.score(lost, eps(A, B)) == [1.0, 0.0]
    with pytest.raises(ConfigError, match="beyondCache must be true or false"):
        Scheduler.from_config(single("prefix-cache-scorer", {"beyondCache": "yes"}))


def test_ttft_estimate_counts_queue_prefill_and_transfer():
    scorer = TTFTEstimateScorer(
        prefill_tokens_per_s=1000.0,
        queued_request_s=0.1,
        kv_bytes_per_token=1e6,
        tier_gbps={Medium.GPU: 0.0, Medium.CPU: 1.0, Medium.DISK: 0.1, Medium.SHARED: 0.1},
        max_batched_tokens=100,
    )
    r = req()
    r.prefix = PrefixMatch(8, 16, {A: PodMatch(8, {Medium.GPU: 8}), B: PodMatch(8, {Medium.CPU: 8})})
    a, b = EndpointState(A, waiting=2), EndpointState(B)
    c = EndpointState(C, pending_prefill_tokens=300, running=20, waiting=1)
    assert scorer.estimate(r, a) == pytest.approx(0.2 + 0.001)  # the engine's queue, the last token
    assert scorer.estimate(r, b) == pytest.approx(128 * 1e6 / 1e9 + 0.001)  # CPU -> GPU transfer
    # 300 tokens this router already sent + its own 128, with 20 of every 100 step tokens decoding
    assert scorer.estimate(r, c) == pytest.approx((300 + 128) / 1000 / 0.8)
    scores = scorer.score(r, [a, b, c])
    assert scores[1] == 1.0 and scores[0] == pytest.approx(0.129 / 0.201)
    # an engine that reports its KV size is priced at it, not at the configured one
    assert scorer.estimate(r, EndpointState(B, kv_bytes_per_token=250_000)) == pytest.approx(0.032 + 0.001)


def test_ttft_estimate_uses_the_learned_speed_within_bounds():
    scorer = TTFTEstimateScorer(1000.0, 0.0, 0.0, {}, max_learned_ratio=4.0)
    r = req()  # 128 uncached tokens
    assert scorer.estimate(r, EndpointState(A)) == pytest.approx(0.128)
    assert scorer.estimate(r, EndpointState(A, seconds_per_prefill_token=0.002)) == pytest.approx(0.256)
    assert scorer.estimate(r, EndpointState(A, seconds_per_prefill_token=1.0)) == pytest.approx(0.512)


def test_ttft_estimate_moves_a_prefix_off_a_saturated_holder():
    scorer = TTFTEstimateScorer(1000.0, 0.0, 0.0, {})
    r = req()
    r.prefix = PrefixMatch(8, 16, {A: PodMatch(6, {Medium.GPU: 6})})
    idle_holder, other = EndpointState(A), EndpointState(B)
    assert scorer.score(r, [idle_holder, other]) == [1.0, pytest.approx(32 / 128)]  # 32 vs 128 to compute
    busy_holder = EndpointState(A, pending_prefill_tokens=400)  # backlog > recomputing 96 tokens
    scores = scorer.score(r, [busy_holder, other])
    assert scores[1] == 1.0 and scores[0] < 1.0


def test_ttft_estimate_weighs_each_prompt_token_by_its_position():
    # with attention doubling a token's cost at position 128, the prompt's 128 tokens cost
    # 128 + 128**2 / 256 = 192 tokens at position 0; with 64 cached, 64 + (128**2 - 64**2) / 256 = 112
    scorer = TTFTEstimateScorer(1000.0, 0.0, 0.0, {}, attention_context=128.0)
    cold = req()
    assert scorer.estimate(cold, EndpointState(A)) == pytest.approx(0.192)
    warm = req()
    warm.prefix = PrefixMatch(8, 16, {A: PodMatch(4, {Medium.GPU: 4})})
    assert scorer.estimate(warm, EndpointState(A)) == pytest.approx(0.112)
    assert TTFTEstimateScorer(1000.0, 0.0, 0.0, {}).estimate(warm, EndpointState(A)) == pytest.approx(0.064)


def test_the_ledger_weighs_work_as_the_ttft_scorer_of_its_config():
    config = load_scheduler_config("precise")
    assert attention_context_of(config) == 30_000.0  # the default prices tokens by position
    config["plugins"][0]["parameters"]["attentionContextTokens"] = 12_000
    assert attention_context_of(config) == 12_000.0
    s = Scheduler.from_config(config, index=InMemoryIndex(capacity=None), rng=random.Random(0))
    scorer = next(w.scorer for w in s.profiles["default"].scorers if isinstance(w.scorer, TTFTEstimateScorer))
    assert scorer.attention_context == 12_000.0
    config["plugins"][0]["parameters"]["attentionContextTokens"] = 30_000
    assert attention_context_of(config) == 30_000.0
    s = Scheduler.from_config(config, index=InMemoryIndex(capacity=None), rng=random.Random(0))
    scorer = next(w.scorer for w in s.profiles["default"].scorers if isinstance(w.scorer, TTFTEstimateScorer))
    assert scorer.attention_context == 30_000.0
    assert attention_context_of(load_scheduler_config("load")) == 0.0  # no TTFT scorer


def test_pd_decider_splits_only_long_uncached_prompts():
    idx = index_with({B: (8, Medium.GPU)})
    s = Scheduler.from_config(load_scheduler_config("pd"), index=idx, rng=random.Random(0))
    pool = [
        EndpointState(A, role=Role.PREFILL),
        EndpointState(B, role=Role.DECODE),
        EndpointState(C, role=Role.DECODE),
    ]
    # cached on decode pod B: no prefill leg
    d = s.pick(req(), pool)
    assert d is not None and (d.endpoint, d.prefill) == (B, None)
    # 400 uncached tokens > threshold 256: prefill on A first, decode on a decode pod
    long_prompt = list(range(90_000, 90_400))
    d = s.pick(req(1, tokens=long_prompt), pool)
    assert d is not None and d.prefill == A and d.endpoint in (B, C)
    assert d.profile == "decode"
    # no prefill pod alive: decode does the whole request
    pool[0].healthy = False
    d = s.pick(req(2, tokens=long_prompt), pool)
    assert d is not None and d.prefill is None


def test_weighted_random_picker_draws_among_top_k():
    s = Scheduler.from_config(single("queue-scorer", picker="weighted-random-picker"), rng=random.Random(4))
    pool = [EndpointState(A, waiting=0), EndpointState(B, waiting=5), EndpointState(C, waiting=10)]
    counts = Counter(s.pick(req(i), pool).endpoint for i in range(500))  # type: ignore[union-attr]
    assert counts[C] == 0  # outside the top 2
    assert counts[A] > counts[B] > 0


def test_scorer_timing_uses_injected_clock():
    ticks = iter(range(1000))
    seen: list[tuple[str, float]] = []
    s = Scheduler.from_config(
        load_scheduler_config("load"),
        clock=lambda: float(next(ticks)),
        on_timing=lambda n, t: seen.append((n, t)),
    )
    s.pick(req(), eps(A, B))
    assert [n for n, _ in seen] == ["queue-scorer", "active-request-scorer", "kv-cache-utilization-scorer"]
    assert all(t == 1.0 for _, t in seen)


def test_scores_are_clamped():
    class Wild:
        def score(self, request, endpoints):
            return [7.0, -3.0]

    s = Scheduler.from_config(single("queue-scorer"))
    s.profiles["default"].scorers[0] = WeightedScorer("wild", Wild(), 1.0)  # makes no range promise
    d = s.pick(req(), eps(A, B))
    assert d is not None and d.scores == {A: 1.0, B: 0.0}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"plugins": [{"type": "nope"}], "schedulingProfiles": [{"name": "default"}]}, "unknown plugin type"),
        ({"plugins": [], "schedulingProfiles": []}, "non-empty"),
        (
            {
                "plugins": [{"type": "queue-scorer", "parameters": {"x": 1}}],
                "schedulingProfiles": [{"name": "d"}],
            },
            "unknown parameters",
        ),
        (
            {"plugins": [], "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "ghost"}]}]},
            "no filter, scorer or picker",
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "schedulingProfiles": [
                    {"name": "d", "plugins": [{"pluginRef": "queue-scorer", "weight": -1}]}
                ],
            },
            "non-negative",
        ),
        (
            {
                "plugins": [{"type": "weighted-random-picker", "parameters": {"topK": 0}}],
                "schedulingProfiles": [{"name": "d"}],
            },
            ">= 1",
        ),
        (
            {"plugins": [{"type": "pd-profile-handler"}], "schedulingProfiles": [{"name": "default"}]},
            "not defined",
        ),
        ({"plugins": [], "schedulingProfiles": [{"name": "a"}, {"name": "b"}]}, "default"),
        ({"plugin": []}, "unknown scheduler config keys"),
        (
            {
                "plugins": [
                    {"type": "precise-prefix-cache-scorer", "parameters": {"tierWeights": {"TAPE": 1}}}
                ],
                "schedulingProfiles": [{"name": "d"}],
            },
            "unknown tier",
        ),
    ],
)
def test_bad_configs_are_rejected_with_a_message(config, message):
    with pytest.raises(ConfigError, match=message):
        Scheduler.from_config(config)


def test_unknown_preset_or_file():
    with pytest.raises(ConfigError, match="not a preset"):
        load_scheduler_config("fastest")


@pytest.mark.parametrize("arity", [1, 2, 3, 4, 5])
def test_combined_scores_are_the_weighted_mean_at_every_arity(arity):
    from kvmesh.router.scheduler import combine_scores

    rng = random.Random(arity)
    columns = [[rng.random() for _ in range(6)] for _ in range(arity)]
    weights = [rng.uniform(0.01, 3.0) for _ in range(arity)]
    expected = [
        sum(w * col[i] for w, col in zip(weights, columns, strict=True)) / sum(weights) for i in range(6)
    ]
    assert combine_scores(columns, weights, 6) == pytest.approx(expected, rel=1e-12)


def test_out_of_range_scores_are_clamped_unless_the_scorer_promises_the_range():
    from kvmesh.router.scheduler import clamp_scores, combine_scores

    assert clamp_scores([-0.5, 0.25, 1.5, float("nan")]) == [0.0, 0.25, 1.0, 0.0]
    in_range = [0.0, 0.5, 1.0]
    assert clamp_scores(in_range) is in_range
    assert combine_scores([[1.0, 0.0], [0.5, 0.5]], [3.0, 1.0], 2) == [(3.0 + 0.5) / 4, 0.5 / 4]
    s = Scheduler.from_config(
        {
            "plugins": [
                {"type": "precise-prefix-cache-scorer", "parameters": {"tierWeights": {"GPU": 2.0}}},
                {"type": "queue-scorer"},
                {"type": "max-score-picker"},
            ],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [
                        {"pluginRef": "precise-prefix-cache-scorer", "weight": 1},
                        {"pluginRef": "queue-scorer", "weight": 1},
                        {"pluginRef": "max-score-picker"},
                    ],
                }
            ],
        },
        block_size=4,
    )
    clamps = {ws.name: ws.clamp for ws in s.profiles["default"].scorers}
    # a GPU block worth 2 can push the prefix score past 1; queue scores are min-max normalized
    assert clamps == {"precise-prefix-cache-scorer": True, "queue-scorer": False}


def test_rank_is_picks_ranking_without_the_decision():
    a = Scheduler.from_config(load_scheduler_config("precise"), rng=random.Random(5))
    b = Scheduler.from_config(load_scheduler_config("precise"), rng=random.Random(5))
    for i in range(20):
        d = a.pick(req(i), eps(A, B, C))
        assert d is not None and b.rank(req(i), eps(A, B, C)) == d.ranked
    pd = Scheduler.from_config(load_scheduler_config("pd"))
    with pytest.raises(ValueError, match="P/D"):
        pd.rank(req(), eps(A, B))


def test_router_cli_offers_every_preset():
    from kvmesh.router import cli

    assert cli._POLICIES == PRESET_NAMES


class _ScoresNothing:
    """Has a picker's method only."""

    def pick(self, endpoints: list[EndpointState], scores: list[float]) -> list[PodId]:
        return [e.pod for e in endpoints]


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (
            PluginKind.SCORER,
            "is registered as a scorer, but _ScoresNothing lacks score, scores_in_unit_range",
        ),
        (PluginKind.FILTER, "is registered as a filter, but _ScoresNothing lacks filter"),
    ],
)
def test_a_plugin_lacking_its_kinds_methods_is_rejected_at_load(monkeypatch, kind, message):
    monkeypatch.setitem(
        REGISTRY, "odd-plugin", Registration(kind, lambda name, params, ctx: _ScoresNothing())
    )
    config = {
        "plugins": [{"type": "odd-plugin", "name": "odd"}],
        "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "odd"}]}],
    }
    with pytest.raises(ConfigError, match="plugin 'odd' \\(type 'odd-plugin'\\) " + message):
        Scheduler.from_config(config)


def test_every_registered_plugin_conforms_to_its_kind():
    for type_name, registration in REGISTRY.items():
        plugin = registration.factory(type_name, Params(type_name, {}), PluginContext())
        assert isinstance(plugin, registration.kind.protocol), type_name


def test_no_attribute_probing_dispatch_in_the_router():
    router = Path(__file__).resolve().parents[2] / "src" / "kvmesh" / "router"
    probing = [
        f"{path.relative_to(router)}:{n}"
        for path in sorted(router.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "hasattr(" in line
    ]
    assert probing == []


def test_hasher_is_one_per_namespace_value_whichever_object_asks():
    sched = Scheduler.from_config(load_scheduler_config("precise"), block_size=16)
    a, b = NS.for_tenant("a"), NS.for_tenant("b")
    hasher_a = sched.hasher(a)
    assert hasher_a.namespace == a
    assert sched.hasher(a) is hasher_a
    assert sched.hasher(NS.for_tenant("a")) is hasher_a  # an equal namespace, another object
    hasher_b = sched.hasher(b)
    assert hasher_b is not hasher_a and hasher_b.namespace == b
    assert sched.hasher(a) is hasher_a and sched.hasher(b) is hasher_b
