"""The llm-d presets: well-formed, and the scheduler ordering shows up on a short slice of the load."""

import dataclasses

import pytest

from kvmesh.bench.workloads import Stage
from kvmesh.errors import ConfigError
from kvmesh.sim.fleet import simulate
from kvmesh.sim.presets import PRESETS, get_scenario
from kvmesh.sim.report import build_report


def test_presets_are_complete():
    assert set(PRESETS) == {"llmd-73-capacity", "llmd-37-capacity"}
    for scenario in PRESETS.values():
        assert (
            set(scenario.schedulers)
            == set(scenario.published)
            == {"precise", "approximate", "load", "random"}
        )
        pubs = scenario.published
        assert pubs["precise"].ttft_p90_s < pubs["approximate"].ttft_p90_s < pubs["load"].ttft_p90_s
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
