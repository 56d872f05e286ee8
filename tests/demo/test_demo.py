"""The demo's real-model workload shape and its explanation."""

from __future__ import annotations

import asyncio
import io

import pytest
from rich.console import Console

from kvmesh.bench.metrics import RequestResult, RunResult, summarize
from kvmesh.demo import real_vllm, run
from kvmesh.demo.run import (
    REAL_KV_CAPACITY_TOKENS,
    DemoOptions,
    explain_real,
    real_cycles,
    real_workload,
    resolve_engine,
)
from kvmesh.errors import FleetError


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("replicas", [2, 3, 4, 5, 8])
def test_real_workload_never_repeats_a_prompt_on_a_round_robin_replica_that_saw_it(quick, replicas):
    w = real_workload(quick, replicas)
    specs = list(w.requests())
    num_prompts = w.num_groups * w.num_prompts_per_group
    assert len(specs) == real_cycles(quick, replicas) * num_prompts
    seen_on: dict[tuple[int, ...], set[int]] = {}
    for j, s in enumerate(specs):
        replicas_seen = seen_on.setdefault(tuple(s.prompt_token_ids), set())
        assert j % replicas not in replicas_seen
        replicas_seen.add(j % replicas)
    # one group's prompts fit a replica's KV, two groups' do not
    one_group = w.system_prompt_len + w.num_prompts_per_group * w.question_len  # type: ignore[operator]
    assert one_group <= REAL_KV_CAPACITY_TOKENS < 2 * w.system_prompt_len + 2 * w.question_len  # type: ignore[operator]


def _run(label: str, cached: int, ttft: float) -> RunResult:
    results = [
        RequestResult(f"{label}{i}", 0, float(i), True, 100, output_tokens=4, cached_tokens=cached,
                      reusable_prefix_len=80, ttft_s=ttft, e2e_s=ttft + 0.1)
        for i in range(10)
    ]  # fmt: skip
    return RunResult(label, "w", results, [], [], summarize(results), [])


def test_explanation_states_the_measured_ratios():
    text = explain_real(_run("rr", 20, 2.0), _run("precise", 76, 0.5), 4)
    assert "25% of the reusable tokens (1/4 = 25%)" in text
    assert "95% of the reusable tokens came from cache" in text
    assert "p90 TTFT 4.0x lower" in text
    assert "80% of the prompt tokens" in text


def test_explanation_says_higher_when_ttft_got_worse():
    text = explain_real(_run("rr", 20, 0.5), _run("precise", 76, 2.0), 4)
    assert "p90 TTFT 4.0x higher" in text and "median TTFT 4.0x higher" in text


def test_vllm_demo_keeps_kvmesh_cold_requests_under_a_tenth():
    """p90 TTFT shows the warm path only if fewer than 10 % of requests meet their group cold."""
    load = real_vllm.workload(quick=False)
    assert load.num_groups / load.num_requests < 0.10
    assert load.system_prompt_len % 128 == 0  # whole vLLM-CPU blocks


def test_vllm_demo_fleets_differ_only_in_routing_and_sharing(tmp_path):
    base, kvmesh = real_vllm.fleet_configs(2, tmp_path)
    assert (base.engine, kvmesh.engine) == ("vllm", "vllm")
    assert (base.policy, base.shared) == ("round-robin", "none")
    assert (kvmesh.policy, kvmesh.shared) == ("precise", "dir")
    assert base.engine_args == kvmesh.engine_args


def test_demo_says_why_it_does_not_use_vllm(monkeypatch):
    monkeypatch.setattr(run, "vllm_unavailable_reason", lambda: "vllm-cpu needs AVX2")
    assert resolve_engine(DemoOptions()) == ("kvmesh", "vllm-cpu needs AVX2")
    assert resolve_engine(DemoOptions(engine="kvmesh")) == ("kvmesh", "--engine kvmesh")
    with pytest.raises(FleetError, match="AVX2"):
        resolve_engine(DemoOptions(engine="vllm"))


def test_demo_measures_host_load_before_any_fleet_and_starts_each_fleet_with_its_part(monkeypatch, tmp_path):
    events: list[str] = []

    class RecordingFleet:
        def __init__(self, config):
            self.config = config
            self.name = config.run_dir.name

        async def start(self):
            events.append(f"start {self.name}")

        async def aclose(self):
            events.append(f"close {self.name}")

    async def load_probe():
        events.append("load")
        return None

    async def fake_real(options, console, fleets):
        for fleet in fleets:
            await fleet.start()
            events.append(f"run {fleet.name}")
            await fleet.aclose()
        return {}

    async def fake_emulated(options, console, fleet):
        await fleet.start()
        events.append(f"run {fleet.name}")
        await fleet.aclose()
        return {}

    monkeypatch.setattr(run, "Fleet", RecordingFleet)
    monkeypatch.setattr(run, "measure_host_load", load_probe)
    monkeypatch.setattr(run, "run_real", fake_real)
    monkeypatch.setattr(run, "run_emulated", fake_emulated)
    options = DemoOptions(engine="kvmesh", run_dir=tmp_path, progress=False)
    asyncio.run(run.run_demo(options, Console(file=io.StringIO())))
    assert events[0] == "load"
    starts = [i for i, e in enumerate(events) if e.startswith("start")]
    assert [events[i] for i in starts] == ["start round-robin", "start precise", "start emulated"]
    # every fleet is closed before the next one starts
    assert events.index("close round-robin") < events.index("start precise")
    assert events.index("close precise") < events.index("start emulated")
