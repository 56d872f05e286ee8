"""Reports: bench metrics from simulated runs, weighted ITL, fleet figures, JSON."""

import json

import numpy as np
import pytest
from sim_helpers import ListWorkload, spec, tokens

from kvmesh.bench.metrics import Dist
from kvmesh.sim.fleet import FleetConfig, simulate
from kvmesh.sim.report import build_report, weighted_dist
from kvmesh.workload import SharedPrefixWorkload, Stage


def test_weighted_dist_equals_the_pooled_distribution():
    values = np.array([0.03, 0.01, 0.5, 0.02])
    weights = np.array([10, 85, 1, 4])
    pooled = np.repeat(values, weights)
    d = weighted_dist(values, weights)
    assert d.count == 100
    assert d.mean == pytest.approx(pooled.mean())
    assert d.median == 0.01
    assert d.p90 == 0.03  # 85 + 4 values lie below 0.03, the 90th sits among the 10 at 0.03
    assert d.p99 == 0.03
    assert d.max == 0.5
    assert weighted_dist(np.array([]), np.array([])) == Dist()


def test_report_has_bench_metrics_and_fleet_figures():
    wl = ListWorkload([spec(i, i * 0.1, tokens(i % 4, 600), 20) for i in range(40)])
    cfg = FleetConfig(num_replicas=2, model_preset="tiny-h100", policy="precise", shared_tier="redis")
    run = simulate(cfg, wl)
    rep = build_report(run, "precise")
    s = rep.summary
    assert s.num_ok == 40 and s.output_tokens == 40 * 20
    assert s.ttft.p90 >= s.ttft.median > 0
    assert s.itl.count == 40 * 19  # one gap per output token after the first
    assert s.tpot.mean == pytest.approx(np.mean([(r.finish - r.first_token) / 19 for r in run.requests]))
    assert len(rep.replicas) == 2
    assert all(0 <= r.busy_frac <= 1 and 0 <= r.kv_usage_mean <= 1 for r in rep.replicas)
    assert sum(r.num_finished for r in rep.replicas) == 40 and max(r.busy_frac for r in rep.replicas) > 0
    rates = rep.tiers.rates()
    assert rates["total"] == pytest.approx(s.hit_rate)
    assert rep.cost_per_1k_usd > 0
    blob = json.loads(json.dumps(rep.to_dict()))
    assert blob["summary"]["num_ok"] == 40
    assert set(blob["hit_rate_by_tier"]) == {"gpu", "cpu", "shared", "total"}
    assert blob["network"]["write_bytes"] > 0


def test_kv_peak_per_stage_rises_with_the_load():
    wl = SharedPrefixWorkload(
        num_groups=8, num_prompts_per_group=4, system_prompt_len=512, question_len=64, output_len=200,
        stages=[Stage(2.0, 8.0), Stage(30.0, 8.0)], arrival="constant", seed=2,
    )  # fmt: skip
    cfg = FleetConfig(
        num_replicas=2, model_preset="tiny-h100", policy="round-robin", kv_capacity_tokens=40_000,
        queue_sample_interval_s=0.05,
    )  # fmt: skip
    rep = build_report(simulate(cfg, wl))
    low, high = rep.stage_kv_peak
    assert len(rep.stage_kv_peak) == len(rep.run.stages) == 2
    assert 0 < low < high <= 1
    assert json.loads(json.dumps(rep.to_dict()))["stage_kv_peak"] == [low, high]
