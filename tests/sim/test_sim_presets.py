"""The llm-d presets: well-formed, and the scheduler ordering shows up on a short slice of the load."""

import dataclasses

import pytest

from kvmesh.bench.metrics import Dist, Summary
from kvmesh.errors import ConfigError
from kvmesh.sim.fleet import simulate
from kvmesh.sim.presets import PRESETS, get_scenario
from kvmesh.sim.report import build_report
from kvmesh.workload import Stage


def test_presets_are_complete():
    assert set(PRESETS) == {"llmd-73-capacity", "llmd-37-capacity"}
    for scenario in PRESETS.values():
        assert (
            set(scenario.schedulers)
            == set(scenario.published)
            == {"llmd-precise", "approximate", "load", "random"}
        )
        pubs = scenario.published
        assert pubs["llmd-precise"].ttft_p90_s < pubs["approximate"].ttft_p90_s < pubs["load"].ttft_p90_s
        for policy in scenario.schedulers:
            cfg = scenario.fleet_for(policy)
            assert cfg.policy == scenario.schedulers[policy]
            assert cfg.num_replicas == scenario.fleet.num_replicas
    s73 = get_scenario("llmd-73-capacity")
    # resident set of the workload ≈ 73% of the fleet's KV
    resident = 150 * (6000 + 5 * 1200)
    assert resident / (s73.fleet.num_replicas * s73.fleet.kv_capacity_tokens) == pytest.approx(0.73, abs=0.01)
    with pytest.raises(ConfigError, match="llmd-73-capacity"):
        get_scenario("llmd-99")
    s37 = get_scenario("llmd-37-capacity")
    assert s37.fleet.gateways == 2 and s73.fleet.gateways == 1
    stages = s37.workload.stages or []
    for peaks in s37.published_stage_kv_peak.values():
        assert len(peaks) == len(stages)  # warm-up included
        assert all(p is None or 0 < p <= 1 for p in peaks)


@pytest.mark.slow
def test_precise_beats_random_when_random_saturates():
    scenario = get_scenario("llmd-73-capacity")
    # the warm-up cycle, then 25 QPS: past the point where random routing saturates the fleet
    wl = dataclasses.replace(scenario.workload, stages=[Stage(15.0, 50.0), Stage(25.0, 20.0)])
    precise = build_report(simulate(scenario.fleet_for("precise"), wl))
    rnd = build_report(simulate(scenario.fleet_for("random"), wl))
    assert precise.summary.hit_rate > rnd.summary.hit_rate + 0.3, (
        precise.summary.hit_rate,
        rnd.summary.hit_rate,
    )
    assert 5 * precise.summary.ttft.p90 < rnd.summary.ttft.p90, (
        precise.summary.ttft.p90,
        rnd.summary.ttft.p90,
    )


def _stage(index: int, p90: float, tput: float) -> Summary:
    """A stage summary carrying only what the aggregation reads."""
    return Summary(
        num_requests=1, num_ok=1, num_failed=0, duration_s=1.0, request_throughput=1.0,
        output_throughput=tput, prompt_tokens=0, output_tokens=0, cached_tokens=0, reusable_tokens=0,
        hit_rate=0.0, reusable_hit_rate=0.0, ttft=Dist(mean=p90, p90=p90), tpot=Dist(), itl=Dist(),
        e2e=Dist(), stage=index,
    )  # fmt: skip


def test_stage_aggregation_reproduces_llmd_37_published_p90():
    s37 = get_scenario("llmd-37-capacity")
    assert s37.aggregation == "stages"
    for policy in ("llmd-precise", "approximate", "load", "random"):
        published = s37.published_stage_p90[policy]
        assert published is not None
        # warm-up first (excluded whatever its value), then the published per-stage p90s
        stages = [_stage(0, 999.0, 1.0), *(_stage(i + 1, p, 100.0) for i, p in enumerate(published))]
        headline = s37.aggregate(_stage(-1, 0.0, 0.0), stages)
        assert headline.ttft_p90_s == pytest.approx(s37.published[policy].ttft_p90_s, abs=0.01), policy
        assert headline.output_tok_s == pytest.approx(100.0)
    # llm-d's slot math: per pod, KV less 8 requests × 1500 ephemeral tokens, in 8000-token prefixes;
    # 83 prefixes fill 37% of the fleet's slots
    assert s37.fleet.kv_capacity_tokens is not None
    slots = s37.fleet.num_replicas * ((s37.fleet.kv_capacity_tokens - 8 * 1500) // 8000)
    assert slots == 224 and 83 / slots == pytest.approx(0.37, abs=0.005)


def test_pooled_aggregation_reads_the_run_summary():
    s73 = get_scenario("llmd-73-capacity")
    assert s73.aggregation == "pooled"
    headline = s73.aggregate(_stage(-1, 0.5, 1234.0), [_stage(1, 9.0, 1.0)])
    assert (headline.ttft_p90_s, headline.output_tok_s) == (0.5, 1234.0)
