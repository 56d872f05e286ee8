"""Think time: a session request with ``gap_after_previous_s`` is sent that long after the previous one
finished, whether it was queued behind it or arrived after it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest

from kvmesh.sim.fleet import FleetConfig, simulate
from kvmesh.workload import AgenticWorkload, RequestSpec


@dataclass
class Specs:
    specs: list[RequestSpec]
    name: str = "specs"

    def requests(self) -> Iterator[RequestSpec]:
        for s in self.specs:
            yield replace(s, prompt_token_ids=list(s.prompt_token_ids))


def _fleet() -> FleetConfig:
    return FleetConfig(num_replicas=2, model_preset="tiny-h100", policy="precise")


def _spec(i: int, arrival: float, gap: float | None, session: str | None = "a") -> RequestSpec:
    tokens = [100 + (7 * i + j) % 900 for j in range(64)]
    return RequestSpec(f"r{i}", arrival, tokens, 4, session_id=session, gap_after_previous_s=gap)


def test_queued_turns_wait_the_think_time_after_the_previous_finished():
    run = simulate(_fleet(), Specs([_spec(0, 0.0, None), _spec(1, 0.0, 2.0), _spec(2, 0.0, 0.5)]))
    r0, r1, r2 = run.requests
    assert r1.arrival == pytest.approx(r0.finish + 2.0)
    assert r2.arrival == pytest.approx(r1.finish + 0.5)
    assert r2.first_token > r2.arrival


def test_a_turn_arriving_after_the_previous_finished_still_waits_out_the_gap():
    (alone,) = simulate(_fleet(), Specs([_spec(0, 0.0, None)])).requests
    done = alone.finish
    specs = [
        _spec(0, 0.0, None),
        _spec(1, done + 0.1, 1.0),  # arrives idle, 0.1 s after the finish: sent at finish + 1.0
        _spec(2, 500.0, 1.0),  # arrives long after finish + gap: sent on arrival
        _spec(3, 500.0, None),  # no gap: sent when the previous finished
    ]
    r0, r1, r2, r3 = simulate(_fleet(), Specs(specs)).requests
    assert r0.finish == pytest.approx(done)
    assert r1.arrival == pytest.approx(done + 1.0)
    assert r2.arrival == pytest.approx(500.0)
    assert r3.arrival == pytest.approx(r2.finish)


def test_requests_without_a_session_ignore_the_gap():
    r0, r1 = simulate(_fleet(), Specs([_spec(0, 0.0, None, None), _spec(1, 0.0, 3.0, None)])).requests
    assert r0.arrival == r1.arrival == 0.0


def test_agentic_sessions_run_turn_after_turn_with_their_think_times():
    w = AgenticWorkload(
        num_sessions=4,
        session_interval_s=0.5,
        system_prompt_len=256,
        task_len=200,
        num_turns={"median": 6, "sigma": 0.5, "min": 3, "max": 10},
        output_len=8,
        tool_result_len={"median": 60, "sigma": 1.0, "min": 1, "max": 500},
        max_context_tokens=1500,
        summary_len=200,
        block_tokens=64,
    )
    gaps = {s.request_id: s.gap_after_previous_s for s in w.block_requests()}
    run = simulate(_fleet(), w)
    assert len(run.requests) == len(gaps) and all(r.failed is None for r in run.requests)
    by_session: dict[str, list] = {}
    for r in run.requests:
        by_session.setdefault(r.group, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: int(r.request_id.rsplit("-t", 1)[1]))
        assert gaps[turns[0].request_id] is None
        for prev, cur in itertools.pairwise(turns):
            gap = gaps[cur.request_id]
            assert gap is not None
            assert cur.arrival == pytest.approx(prev.finish + gap)
    # one context at a time per session: most of every later turn is found on the device
    later = [r for r in run.requests if gaps[r.request_id] is not None]
    assert sum(r.hit_gpu for r in later) > 0.8 * sum(r.prompt_len for r in later)
