"""The simulator against a real emulated fleet (engines + router as processes) on one workload.

Same engines' cost-model preset, block size and KV capacity, same router policies, same requests:
the simulator must agree with the fleet on the prefix-cache hit rate (within 5 points) and on which
policy gives the lower TTFT.
"""

from __future__ import annotations

import pytest

from kvmesh.bench.compare import compare_policies
from kvmesh.bench.runner import RunOptions
from kvmesh.fleet import Fleet
from kvmesh.fleet import FleetConfig as LaunchConfig
from kvmesh.sim.fleet import FleetConfig, simulate
from kvmesh.sim.report import build_report
from kvmesh.workload import SharedPrefixWorkload, Stage

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

PRESET = "qwen3-32b-h100-tp2"  # prefills of ~0.1 s: GPU time, not HTTP overhead, decides TTFT
POLICIES = ["precise", "round-robin"]
NUM_ENGINES = 3


def workload() -> SharedPrefixWorkload:
    return SharedPrefixWorkload(
        num_groups=6, num_prompts_per_group=4, system_prompt_len=1536, question_len=128, output_len=4,
        stages=[Stage(3.0, 16.0)], seed=11, vocab_size=259,  # tiny-random-llama vocabulary
    )  # fmt: skip


async def test_simulator_agrees_with_an_emulated_fleet(tmp_path):
    launch = LaunchConfig(
        num_engines=NUM_ENGINES, model="tiny-random-llama", emulate=PRESET, shared="none", policy=POLICIES[0],
        run_dir=tmp_path / "fleet", health_timeout_s=120,
    )  # fmt: skip
    async with Fleet(launch) as fleet:
        real = await compare_policies(
            fleet, workload(), POLICIES, RunOptions(base_url="", model="", progress=False)
        )
    sim = {
        p: build_report(
            simulate(FleetConfig(num_replicas=NUM_ENGINES, model_preset=PRESET, policy=p), workload())
        )
        for p in POLICIES
    }
    for p in POLICIES:
        r, s = real[p].summary, sim[p].summary
        assert r.num_failed == s.num_failed == 0
        assert r.num_ok == s.num_ok
        assert abs(r.hit_rate - s.hit_rate) <= 0.05, (p, r.hit_rate, s.hit_rate)
    assert real["precise"].summary.hit_rate > real["round-robin"].summary.hit_rate
    real_order = sorted(POLICIES, key=lambda p: real[p].summary.ttft.mean)
    sim_order = sorted(POLICIES, key=lambda p: sim[p].summary.ttft.mean)
    assert real_order == sim_order == ["precise", "round-robin"]
