"""The router's flow control in the simulator: overload is shed, not timed out."""

from __future__ import annotations

import json

from kvmesh.cli import main
from kvmesh.router.flow_control import FlowControlConfig
from kvmesh.sim.fleet import FleetConfig, simulate
from kvmesh.sim.report import build_report
from kvmesh.workload import SharedPrefixWorkload, Stage

FLOW = FlowControlConfig(max_predicted_ttft_seconds=2.0, max_queue_wait_seconds=10.0)


def long_prompts(rate: float, duration: float = 30.0) -> SharedPrefixWorkload:
    """3.5k-token prompts, mostly unique: two Llama-8B replicas serve about 25 of them a second."""
    return SharedPrefixWorkload(
        num_groups=8, num_prompts_per_group=50, system_prompt_len=512, question_len=3000, output_len=64,
        stages=[Stage(rate, duration)], seed=1,
    )  # fmt: skip


def fleet(policy: str = "precise", flow: FlowControlConfig | None = FLOW, **kw) -> FleetConfig:
    kw.setdefault("request_timeout_s", 30.0)
    return FleetConfig(
        num_replicas=2, model_preset="llama-3.1-8b-h100", policy=policy, flow_control=flow, **kw
    )


def test_overload_is_shed_instead_of_timing_out():
    wl = long_prompts(rate=60.0)  # more than twice what the fleet serves
    without = build_report(simulate(fleet(flow=None), wl)).summary
    report = build_report(simulate(fleet(), wl))
    s = report.summary
    assert without.num_timeouts > 500 and without.num_shed == 0
    assert s.num_timeouts == 0 and s.num_failed == 0
    assert s.num_shed > 300 and s.num_ok + s.num_shed == s.num_requests
    assert s.num_ok > without.num_ok  # the fleet's time went to requests that got served
    # served requests waited at most the deadline in the router, then what the estimate allowed:
    # none came near the client's timeout (without flow control, 500+ of them ran past it)
    assert s.ttft.max < 0.75 * 30.0
    flow = report.flow
    assert flow is not None and flow.num_shed == s.num_shed and flow.num_removed == 0
    assert flow.num_queued == flow.num_dispatched + flow.num_shed
    assert 0 < flow.wait.max <= 10.0
    shed = [r for r in report.run.results if r.error == "shed_429"]
    assert len(shed) == s.num_shed and all(r.ttft_s is None for r in shed)
    out = report.to_dict()
    assert out["summary"]["num_shed"] == s.num_shed and out["flow_control"]["num_shed"] == s.num_shed


def test_under_overload_work_the_fleet_holds_goes_first():
    """Prompts mostly cached somewhere (repeats of earlier ones) overtake cold ones while the fleet
    is saturated: more of the fleet's time goes to cheap requests, more are served, sooner."""
    wl = long_prompts(rate=60.0)

    def run(share: float):
        flow = FlowControlConfig(
            max_predicted_ttft_seconds=2.0, max_queue_wait_seconds=10.0, continuation_share=share
        )
        return build_report(simulate(fleet(flow=flow), wl)).summary

    fifo, continuing_first = run(0.0), run(0.9)
    assert fifo.num_timeouts == continuing_first.num_timeouts == 0
    # served 1.13x and median TTFT 0.69x with the default routing before a copy's recompute was
    # priced at its endpoint's queue; 1.08x and 0.72x since (its FIFO run serves more itself)
    assert continuing_first.num_ok > 1.05 * fifo.num_ok
    assert continuing_first.hit_rate > fifo.hit_rate
    assert continuing_first.ttft.median < 0.8 * fifo.ttft.median


def test_below_saturation_nothing_changes():
    wl = long_prompts(rate=10.0)
    off = build_report(simulate(fleet(flow=None), wl))
    on = build_report(simulate(fleet(), wl))
    assert [r.ttft_s for r in on.run.results] == [r.ttft_s for r in off.run.results]
    assert on.flow is not None and on.flow.num_queued == 0 and on.summary.num_shed == 0


def test_client_timeouts_of_queued_requests_leave_the_queue():
    # a client that gives up before the router's deadline: some give up while still queued
    flow = FlowControlConfig(max_in_flight_per_endpoint=4, max_queue_wait_seconds=60.0)
    report = build_report(simulate(fleet("load", flow, request_timeout_s=5.0), long_prompts(60.0, 20.0)))
    s, fc = report.summary, report.flow
    assert fc is not None and fc.num_removed > 0 and s.num_shed == 0
    assert fc.num_queued == fc.num_dispatched + fc.num_removed
    assert s.num_timeouts == s.num_failed >= fc.num_removed
    assert s.num_ok + s.num_failed == s.num_requests


def test_load_profiles_use_the_in_flight_bound_across_gateways():
    flow = FlowControlConfig(max_in_flight_per_endpoint=8, max_queue_wait_seconds=10.0)
    report = build_report(simulate(fleet("load", flow, gateways=2), long_prompts(rate=60.0)))
    s = report.summary
    assert s.num_timeouts == 0 and s.num_shed > 0 and s.num_ok > 0
    assert report.flow is not None and report.flow.num_queued > 0


def test_cli_flags_turn_it_on(tmp_path, capsys):
    wl = tmp_path / "w.yaml"
    wl.write_text(
        "type: shared_prefix\nnum_groups: 8\nnum_prompts_per_group: 100\nsystem_prompt_len: 256\n"
        "question_len: 3000\noutput_len: 32\nstages: [{rate: 60, duration: 10}]\nseed: 2\n"
    )
    code = main([
        "sim", "--workload", str(wl), "--replicas", "2", "--model-preset", "llama-3.1-8b-h100",
        "--max-predicted-ttft", "1", "--queue-deadline", "3", "--timeout", "30", "--json",
    ])  # fmt: skip
    assert code == 0
    run = json.loads(capsys.readouterr().out)["precise"]
    assert run["summary"]["num_shed"] > 0 and run["summary"]["num_timeouts"] == 0
    assert run["flow_control"]["wait"]["max"] <= 3.0
    code = main(["sim", "--workload", str(wl), "--replicas", "2", "--model-preset", "llama-3.1-8b-h100"])
    assert code == 0
    assert "shed" not in capsys.readouterr().out  # off by default: no shed column
