"""EngineCore scheduling with the emulated runner: budgets, chunking, reuse, preemption, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.core.hashing import BlockHasher, Namespace
from kvmesh.engine.core import EngineCore, EngineRequest, SchedulerConfig
from kvmesh.engine.emulated_runner import EmulatedRunner
from kvmesh.engine.prefix_cache import PrefixCache
from kvmesh.engine.runner import SamplingParams, StepOutput, StepPlan


class RecordingRunner(EmulatedRunner):
    def __init__(self) -> None:
        super().__init__("tiny-h100", vocab_size=1000, eos_token_ids=(0,))
        self.plans: list[tuple[list[tuple[str, int, int]], list[str]]] = []
        self.freed: list[str] = []

    async def execute(self, plan: StepPlan) -> StepOutput:
        self.plans.append(
            (
                [(c.seq.request_id, c.start, c.end) for c in plan.prefills],
                [s.request_id for s in plan.decodes],
            )
        )
        return await super().execute(plan)

    def free(self, seq) -> None:  # type: ignore[no-untyped-def]
        self.freed.append(seq.request_id)
        super().free(seq)


def make_core(capacity_tokens: int = 65_536, **cfg) -> tuple[EngineCore, RecordingRunner]:
    runner = RecordingRunner()
    cache = PrefixCache(capacity_tokens, 16, BlockHasher(Namespace("m"), 16), keep_kv=False)
    return EngineCore(runner, cache, SchedulerConfig(**cfg)), runner


async def finish(req: EngineRequest) -> tuple[list[int], str | None]:
    tokens: list[int] = []
    reason = None
    async for out in req:
        tokens += out.new_token_ids
        reason = out.finish_reason
    return tokens, reason


async def test_chunked_prefill_then_decode() -> None:
    core, runner = make_core(max_num_batched_tokens=2048)
    await core.start()
    try:
        req = await core.add_request(EngineRequest("r", list(range(1, 5001)), SamplingParams(max_tokens=3)))
        tokens, reason = await finish(req)
    finally:
        await core.aclose()
    assert len(tokens) == 3 and reason == "length"
    assert [p[0] for p in runner.plans[:3]] == [[("r", 0, 2048)], [("r", 2048, 4096)], [("r", 4096, 5000)]]
    assert [p[1] for p in runner.plans[3:]] == [["r"], ["r"]]
    assert req.seq.token_ids[5000:] == tokens
    assert core.cache.num_used_blocks == 0 and runner.freed == ["r"]


async def test_cached_prefix_never_covers_the_last_prompt_token() -> None:
    core, runner = make_core()
    await core.start()
    try:
        prompt = list(range(1, 33))  # exactly two blocks
        first = await core.add_request(EngineRequest("a", prompt, SamplingParams(max_tokens=1)))
        await finish(first)
        second = await core.add_request(EngineRequest("b", prompt, SamplingParams(max_tokens=1)))
        await finish(second)
    finally:
        await core.aclose()
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 16 and second.cached_tier == "GPU"
    assert runner.plans[-1][0] == [("b", 16, 32)]
    assert core.stats.num_prefix_hit_tokens == 16
    assert core.stats.cached_tokens_by_tier == {"GPU": 16}


async def test_max_num_seqs_bounds_the_batch_fcfs() -> None:
    core, runner = make_core(max_num_seqs=2)
    await core.start()
    try:
        reqs = [
            await core.add_request(EngineRequest(f"r{i}", [i + 1] * 40, SamplingParams(max_tokens=4)))
            for i in range(4)
        ]
        results = await asyncio.gather(*(finish(r) for r in reqs))
    finally:
        await core.aclose()
    assert all(len(t) == 4 for t, _ in results)
    for prefills, decodes in runner.plans:
        assert len({rid for rid, _, _ in prefills} | set(decodes)) <= 2
    first_seen = []
    for prefills, _ in runner.plans:
        first_seen += [rid for rid, start, _ in prefills if start == 0 or rid not in first_seen]
    assert list(dict.fromkeys(first_seen)) == ["r0", "r1", "r2", "r3"]


async def test_decode_out_of_blocks_preempts_and_recomputes() -> None:
    # 7 blocks of 16: two requests of 40 prompt tokens hold 2 full blocks each, and their 8-token
    # tails plus a block of slack each take the other 3. The first generated tokens need a fourth
    # block there: the later request is preempted, and re-runs its prompt and token afterwards.
    core, runner = make_core(capacity_tokens=112)
    await core.start()
    try:
        a = await core.add_request(
            EngineRequest("a", [1] * 40, SamplingParams(max_tokens=20, ignore_eos=True))
        )
        b = await core.add_request(
            EngineRequest("b", [2] * 40, SamplingParams(max_tokens=20, ignore_eos=True))
        )
        (ta, ra), (tb, rb) = await asyncio.gather(finish(a), finish(b))
    finally:
        await core.aclose()
    assert (len(ta), ra, len(tb), rb) == (20, "length", 20, "length")
    assert core.stats.num_preemptions >= 1
    recompute = [p for p, _ in runner.plans if p and p[0][0] == "b" and p[0][2] > 40]
    assert recompute, "the preempted request must recompute its prompt and generated tokens"
    assert core.cache.num_used_blocks == 0
    # Both prompts were cold; finding its own blocks again after preemption is not a prefix hit.
    assert (a.num_reported_cached_tokens, b.num_reported_cached_tokens) == (0, 0)


async def test_abort_running_request_frees_slot_and_blocks(eventually) -> None:
    core, runner = make_core()
    await core.start()
    try:
        req = await core.add_request(EngineRequest("x", [5] * 100, SamplingParams(max_tokens=100_000 - 200)))
        assert await eventually(lambda: req.num_output_tokens >= 3)
        assert core.num_running == 1 and core.cache.num_used_blocks > 0
        core.abort("x")
        _, reason = await finish(req)
        assert reason == "abort"
        assert core.num_running == 0 and core.cache.num_used_blocks == 0
        assert runner.freed == ["x"]
        core.abort("x")  # idempotent
    finally:
        await core.aclose()


async def test_duplicate_and_empty_requests_are_refused() -> None:
    core, _ = make_core()
    await core.start()
    try:
        req = await core.add_request(EngineRequest("d", [1, 2, 3], SamplingParams(max_tokens=50)))
        with pytest.raises(ValueError, match="already in use"):
            await core.add_request(EngineRequest("d", [1, 2, 3], SamplingParams()))
        with pytest.raises(ValueError, match="at least one token"):
            await core.add_request(EngineRequest("e", [], SamplingParams()))
        await finish(req)
    finally:
        await core.aclose()


async def test_eos_stops_unless_ignored() -> None:
    class EosRunner(RecordingRunner):
        def _sample(self, seq) -> int:  # type: ignore[no-untyped-def]
            return 0

    runner = EosRunner()
    cache = PrefixCache(4096, 16, keep_kv=False)
    core = EngineCore(runner, cache)
    await core.start()
    try:
        stop = await core.add_request(EngineRequest("s", [1] * 5, SamplingParams(max_tokens=10)))
        ignore = await core.add_request(
            EngineRequest("i", [1] * 5, SamplingParams(max_tokens=10, ignore_eos=True))
        )
        (ts, rs), (ti, ri) = await asyncio.gather(finish(stop), finish(ignore))
    finally:
        await core.aclose()
    assert (ts, rs) == ([0], "stop")
    assert (len(ti), ri) == (10, "length")


class BrokenStore:
    """A store whose every call fails: the engine must recompute, not fail the request."""

    chunk_size = 16

    def __init__(self) -> None:
        self.calls = 0

    def store_keys(self, tokens, tenant):  # type: ignore[no-untyped-def]
        return [str(i) for i in range(len(tokens) // self.chunk_size)]

    async def retrieve(self, tokens, tenant, keys, beyond=0):  # type: ignore[no-untyped-def]
        self.calls += 1
        raise RuntimeError("store bug")

    async def store(self, write):  # type: ignore[no-untyped-def]
        raise RuntimeError("store bug")

    async def drain(self) -> None:
        return None

    def watch_local_tiers(self, listener):  # type: ignore[no-untyped-def]
        return None

    async def aclose(self) -> None:
        return None


async def test_a_failing_store_means_recompute(caplog) -> None:
    runner = RecordingRunner()
    store = BrokenStore()
    core = EngineCore(runner, PrefixCache(4096, 16, keep_kv=False), store=store)  # type: ignore[arg-type]
    await core.start()
    try:
        req = await core.add_request(EngineRequest("s", list(range(1, 100)), SamplingParams(max_tokens=2)))
        tokens, reason = await finish(req)
    finally:
        await core.aclose()
    assert (len(tokens), reason) == (2, "length")
    assert store.calls == 1 and core.stats.num_store_read_failures == 1
    assert req.num_cached_tokens == 0
    assert "store read failed" in caplog.text
