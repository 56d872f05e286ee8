"""The simulator runs the engine's own scheduler: one request sequence, identical step plans in both."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from sim_helpers import ListWorkload, spec, tokens

from kvmesh.engine.core import EngineCore, EngineRequest, SchedulerConfig
from kvmesh.engine.emulated_runner import EmulatedRunner
from kvmesh.engine.prefix_cache import PrefixCache
from kvmesh.engine.runner import SamplingParams, StepOutput, StepPlan
from kvmesh.engine.step_scheduler import SchedulerOutput, StepScheduler
from kvmesh.sim.fleet import FleetConfig, simulate

PRESET = "tiny-h100"
CAPACITY = 448  # 28 blocks: the batch outgrows it, so requests are preempted and recompute
BATCHED = 96  # prompts take several chunks
SEQS = 4

Plan = tuple[tuple[tuple[str, int, int], ...], tuple[str, ...]]


def workload() -> list[tuple[str, list[int], int]]:
    shared = tokens(7, 80)
    reqs = [
        ("a", shared + tokens(1, 30), 40),
        ("b", tokens(2, 150), 25),
        ("c", shared + tokens(3, 45), 60),
        ("d", tokens(4, 20), 8),
        ("e", shared + tokens(5, 10), 30),
        ("f", tokens(6, 200), 12),
    ]
    return [(rid, toks, out) for rid, toks, out in reqs]


@pytest.fixture
def recorded(monkeypatch) -> Iterator[dict[int, list[Plan]]]:
    """Every step each StepScheduler plans, a k-step decode run counted as k steps."""
    plans: dict[int, list[Plan]] = {}
    schedule = StepScheduler.schedule

    def record(self: StepScheduler, max_steps: int = 1) -> SchedulerOutput:  # type: ignore[type-arg]
        out = schedule(self, max_steps)
        if not out.empty:
            prefills = tuple((r.request_id, start, end) for r, start, end in out.prefills)
            decodes = tuple(r.request_id for r in self.decoding_requests())
            plans.setdefault(id(self), []).extend([(prefills, decodes)] * out.num_steps)
        return out

    monkeypatch.setattr(StepScheduler, "schedule", record)
    yield plans


class RecordingRunner(EmulatedRunner):
    def __init__(self) -> None:
        super().__init__(PRESET, vocab_size=1000, eos_token_ids=(0,))
        self.plans: list[Plan] = []

    async def execute(self, plan: StepPlan) -> StepOutput:
        prefills = tuple((c.seq.request_id, c.start, c.end) for c in plan.prefills)
        self.plans.append((prefills, tuple(s.request_id for s in plan.decodes)))
        return await super().execute(plan)


def engine_plans(recorded: dict[int, list[Plan]]) -> tuple[list[Plan], list[Plan], int]:
    async def run() -> tuple[list[Plan], list[Plan], int]:
        runner = RecordingRunner()
        cache = PrefixCache.create_simulated(CAPACITY, 16)
        core = EngineCore(runner, cache, SchedulerConfig(max_num_seqs=SEQS, max_num_batched_tokens=BATCHED))
        reqs = []
        for rid, toks, out in workload():  # all queued before the first step, as in the simulator
            sp = SamplingParams(max_tokens=out, ignore_eos=True)
            reqs.append(await core.add_request(EngineRequest(rid, toks, sp)))
        await core.start()
        try:
            for req in reqs:
                async for _ in req:
                    pass
        finally:
            await core.aclose()
        assert [r.num_output_tokens for r in reqs] == [out for _, _, out in workload()]
        return recorded[id(core.scheduler)], runner.plans, core.stats.num_preemptions

    return asyncio.run(run())


def sim_plans(recorded: dict[int, list[Plan]]) -> tuple[list[Plan], int]:
    wl = ListWorkload([spec(i, 0.0, toks, out) for i, (_, toks, out) in enumerate(workload())])
    config = FleetConfig(
        num_replicas=1,
        model_preset=PRESET,
        policy="round-robin",
        kv_capacity_tokens=CAPACITY,
        max_num_batched_tokens=BATCHED,
        max_num_seqs=SEQS,
    )
    run = simulate(config, wl)
    assert all(r.failed is None for r in run.requests)
    (replica,) = run.replicas
    names = {f"r{i}": rid for i, (rid, _, _) in enumerate(workload())}
    steps = recorded[id(replica.scheduler)]
    renamed = [
        (tuple((names[r], s, e) for r, s, e in prefills), tuple(names[r] for r in decodes))
        for prefills, decodes in steps
    ]
    return renamed, replica.stats.num_preemptions


def test_engine_and_simulator_plan_identical_steps(recorded):
    # The engine also caches its generated blocks when a request finishes (the simulator has no
    # output token ids); at this capacity they never evict a prompt block a later admission reads.
    engine_steps, executed, engine_preemptions = engine_plans(recorded)
    recorded.clear()
    sim_steps, sim_preemptions = sim_plans(recorded)
    assert executed == engine_steps, "the engine runs exactly what its scheduler planned"
    assert engine_preemptions > 0, "the workload must exercise preemption"
    assert any(len(p) > 1 for p, _ in engine_steps), "and batch several prompt chunks"
    assert sim_preemptions == engine_preemptions
    assert sim_steps == engine_steps
