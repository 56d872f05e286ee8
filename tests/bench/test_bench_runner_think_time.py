"""The load runner's think time: a session request with ``gap_after_previous_s`` is sent that long after
the previous request of its session finished, in open and closed loop (against a stub endpoint)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp import web
from bench_helpers import serve_post

from kvmesh.bench.runner import RunOptions, run_workload
from kvmesh.workload import RequestSpec

SERVICE_S = 0.05


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await asyncio.sleep(SERVICE_S)
    for _ in range(body["max_tokens"]):
        await resp.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
    usage = b'{"prompt_tokens": %d, "completion_tokens": %d}' % (len(body["prompt"]), body["max_tokens"])
    await resp.write(b'data: {"choices": [], "usage": ' + usage + b"}\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest_asyncio.fixture
async def stub_url() -> AsyncIterator[str]:
    async with serve_post("/v1/completions", _completions) as url:
        yield url


def _spec(i: int, session: str, arrival: float, gap: float | None) -> RequestSpec:
    return RequestSpec(
        f"{session}-{i}", arrival, [101, 102, 103], 2, session_id=session, gap_after_previous_s=gap
    )


def _sessions() -> list[RequestSpec]:
    # arrival_s of later turns is a lower bound (the session start plus the gaps before), as workloads set it
    a = [_spec(0, "a", 0.0, None), _spec(1, "a", 0.3, 0.3), _spec(2, "a", 0.5, 0.2)]
    b = [_spec(0, "b", 0.1, None), _spec(1, "b", 0.5, 0.4)]
    return sorted(a + b, key=lambda s: s.arrival_s)


@pytest.mark.parametrize("concurrency", [None, 2])
async def test_turns_are_sent_the_think_time_after_the_previous_finished(stub_url, concurrency):
    specs = _sessions()
    opts = RunOptions(base_url=stub_url, model="m", concurrency=concurrency, progress=False)
    run = await run_workload(specs, opts)
    assert all(r.ok for r in run.results), [r.error for r in run.results if not r.ok]
    got = {r.request_id: r for r in run.results}
    for spec in specs:
        assert got[spec.request_id].send_s >= (spec.arrival_s if concurrency is None else 0.0) - 1e-3
    for session, n in (("a", 3), ("b", 2)):
        for k in range(1, n):
            prev, cur = got[f"{session}-{k - 1}"], got[f"{session}-{k}"]
            gap = next(s.gap_after_previous_s for s in specs if s.request_id == cur.request_id)
            assert gap is not None
            assert cur.send_s >= prev.end_s + gap
            assert cur.send_s < prev.end_s + gap + 0.25  # and not much later
    for prev, cur in itertools.pairwise(sorted(got.values(), key=lambda r: r.request_id)):
        if prev.request_id[0] == cur.request_id[0]:
            assert cur.send_s > prev.end_s


async def test_a_late_arrival_time_still_holds_a_turn_back(stub_url):
    specs = [_spec(0, "a", 0.0, None), _spec(1, "a", 0.6, 0.05)]
    run = await run_workload(specs, RunOptions(base_url=stub_url, model="m", progress=False))
    got = {r.request_id: r for r in run.results}
    assert got["a-1"].send_s >= 0.6 - 1e-3  # arrival_s was later than finish + gap
    assert got["a-0"].end_s + 0.05 < 0.6
