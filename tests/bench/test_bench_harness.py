"""The load runner, trace replay and policy comparison against a real (emulated-GPU) fleet."""

from __future__ import annotations

import itertools
import json

import pytest

from kvmesh.bench.compare import compare_policies, served_model
from kvmesh.bench.runner import RunOptions, run_workload
from kvmesh.workload import MooncakeTraceWorkload, MultiTurnWorkload, SharedPrefixWorkload, Stage

TINY_VOCAB = 256  # ids stay below the tiny byte-level tokenizer's vocabulary

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]


def _shared_prefix(**kw) -> SharedPrefixWorkload:
    params = dict(
        num_groups=3,
        num_prompts_per_group=2,
        system_prompt_len=96,
        question_len=16,
        output_len=5,
        vocab_size=TINY_VOCAB,
    )
    params.update(kw)
    return SharedPrefixWorkload(**params)


async def test_open_loop_run_measures_every_request(emulated_fleet):
    fleet = emulated_fleet
    workload = _shared_prefix(stages=[Stage(8, 1.5, warmup=True), Stage(12, 1.0)], arrival="constant")
    specs = list(workload.requests())
    opts = RunOptions(base_url=fleet.url, model="", metrics_urls=fleet.engine_urls, sample_interval_s=0.1,
                      progress=False, label="precise")  # fmt: skip
    opts.model = await served_model(fleet.url) or ""
    assert opts.model
    run = await run_workload(workload, opts)
    assert [r.request_id for r in sorted(run.results, key=lambda r: r.request_id)] == sorted(
        s.request_id for s in specs
    )
    assert all(r.ok for r in run.results), [r.error for r in run.results if not r.ok]
    for r in run.results:
        assert r.output_tokens == 5
        assert r.prompt_tokens == 112
        assert 0 <= r.cached_tokens < r.prompt_tokens
        assert r.ttft_s is not None and r.e2e_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert r.endpoint in fleet.engine_urls
    measured = [s for s in specs if s.stage == 1]
    assert run.warmup_stages == [0]
    assert run.summary.num_ok == len(measured) < len(specs)  # the warm-up stage is reported on its own row
    assert run.summary.output_tokens == 5 * len(measured)
    assert 0 < run.summary.hit_rate < 1
    assert [s.offered_rate for s in run.stages] == [8, 12]
    assert sum(s.num_requests for s in run.stages) == len(specs)
    assert run.queue, "no /metrics sample was taken"
    assert all(set(q.waiting) == set(fleet.engine_urls) for q in run.queue)


async def test_closed_loop_sessions_run_in_order_through_chat(emulated_fleet):
    fleet = emulated_fleet
    workload = MultiTurnWorkload(num_conversations=3, num_turns=3, tokens_per_turn=12, output_len=3, text=True,
                                 conversation_interval_s=0.0, vocab_size=TINY_VOCAB)  # fmt: skip
    opts = RunOptions(base_url=fleet.url, model=await served_model(fleet.url) or "", api="chat", concurrency=3,
                      progress=False)  # fmt: skip
    run = await run_workload(workload, opts)
    assert all(r.ok for r in run.results), [r.error for r in run.results if not r.ok]
    by_id = {r.request_id: r for r in run.results}
    for c in range(3):
        turns = [by_id[f"multi_turn-c{c}-t{k}"] for k in range(3)]
        for prev, cur in itertools.pairwise(turns):
            assert cur.send_s >= prev.end_s
        # the prompt grows with the history (chat template tokens included)
        assert turns[0].prompt_tokens < turns[1].prompt_tokens < turns[2].prompt_tokens


async def test_mooncake_trace_replay_against_the_fleet(emulated_fleet, tmp_path):
    fleet = emulated_fleet
    rows = [
        {"timestamp": 0, "input_length": 120, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 200, "input_length": 100, "output_length": 3, "hash_ids": [1, 3]},
        {"timestamp": 400, "input_length": 128, "output_length": 2, "hash_ids": [1, 2]},
        {"timestamp": 600, "input_length": 64, "output_length": 5, "hash_ids": [4]},
        {"timestamp": 900, "input_length": 128, "output_length": 4, "hash_ids": [1, 2]},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    workload = MooncakeTraceWorkload(trace, speedup=4.0, block_tokens=64, vocab_size=TINY_VOCAB)
    opts = RunOptions(base_url=fleet.url, model=await served_model(fleet.url) or "", progress=False)
    run = await run_workload(workload, opts)
    assert all(r.ok for r in run.results), [r.error for r in run.results if not r.ok]
    got = {r.request_id: r for r in run.results}
    for i, row in enumerate(rows):
        r = got[f"mooncake-{i}"]
        assert r.prompt_tokens == row["input_length"]
        assert r.output_tokens == row["output_length"]
    # replay keeps the trace's spacing (0.2 s / 4 between the first two), never sending early
    assert got["mooncake-4"].send_s >= 0.9 / 4.0


async def test_failed_requests_are_counted_with_the_server_message(emulated_fleet):
    fleet = emulated_fleet
    workload = _shared_prefix(num_groups=1, num_prompts_per_group=2)
    opts = RunOptions(base_url=fleet.engine_urls[0], model="no-such-model", progress=False)
    run = await run_workload(workload, opts)
    assert run.summary.num_failed == 2 and run.summary.num_ok == 0
    assert all(r.error and r.error.startswith("HTTP 4") for r in run.results)
    bad_port = RunOptions(base_url="http://127.0.0.1:9", model="m", progress=False, request_timeout_s=5)
    run = await run_workload(_shared_prefix(num_groups=1, num_prompts_per_group=1), bad_port)
    assert run.summary.num_failed == 1 and "Client" in (run.results[0].error or "")


async def test_compare_isolates_runs_and_restarts_the_router(emulated_fleet):
    fleet = emulated_fleet
    # a seed no other test of this module uses: the engines may still hold their blocks
    workload = _shared_prefix(num_groups=2, num_prompts_per_group=3, num_requests=12, seed=99)
    opts = RunOptions(base_url=fleet.url, model="", concurrency=2, progress=False)
    runs = await compare_policies(fleet, workload, ["round-robin", "precise"], opts)
    assert list(runs) == ["round-robin", "precise"]
    assert fleet.router_policy == "precise"
    for run in runs.values():
        assert run.summary.num_ok == 12
        # the first request of each group was never seen by this run: nothing may be cached for it,
        # however many blocks earlier runs left in the engines
        firsts = [r for r in run.results if r.reusable_prefix_len == 0]
        assert len(firsts) == 2
        assert all(r.cached_tokens == 0 for r in firsts), [(r.request_id, r.cached_tokens) for r in firsts]
    # round-robin alternates between the two engines
    rr = sorted(runs["round-robin"].results, key=lambda r: r.send_s)
    assert {r.endpoint for r in rr} == set(fleet.engine_urls)


async def test_bench_run_cli_against_a_url(emulated_fleet, tmp_path):
    import asyncio
    import sys

    fleet = emulated_fleet
    cfg = tmp_path / "w.yaml"
    cfg.write_text(
        "load: {type: constant, stages: [{rate: 10, duration: 1}]}\n"
        "data: {type: shared_prefix, shared_prefix: {num_groups: 2, num_prompts_per_group: 2,"
        " system_prompt_len: 64, question_len: 8, output_len: 3, vocab_size: 256}}\n"
    )
    out = tmp_path / "out.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvmesh", "bench", "run", "--url", fleet.url, "--workload", str(cfg),
        "--metrics-url", fleet.engine_urls[0], "--json", str(out), "--requests-json", "--plot-dir",
        str(tmp_path / "plots"), "--no-progress",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    stdout, _ = await proc.communicate()
    assert proc.returncode == 0, stdout.decode()
    assert "TTFT p90" in stdout.decode()
    data = json.loads(out.read_text())
    (run,) = data.values()
    assert run["summary"]["num_ok"] == 9 == len(run["requests"])
    assert (tmp_path / "plots" / "ttft_cdf.png").is_file()
