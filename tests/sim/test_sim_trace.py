"""Trace replay block by block: the figures of the token path, keys of the tokens, the yardstick, the CLI."""

import dataclasses
import json
import random
import weakref
from collections.abc import Iterator

import pytest

from kvmesh.cli import main
from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace
from kvmesh.sim.fleet import FleetConfig, FleetSimulation, simulate
from kvmesh.sim.prompt_keys import PromptKeys
from kvmesh.sim.report import build_report
from kvmesh.workload import BlockTokens, MooncakeTraceWorkload, PromptBlocks, RequestSpec


def trace_rows() -> list[dict]:
    """36 requests of 6 conversations over two shared system blocks; histories grow by a block."""
    rng = random.Random(5)
    rows: list[dict] = []
    t, nxt = 0, 100
    conversations: dict[int, list[int]] = {}
    for _ in range(36):
        t += rng.randrange(50, 400)
        c = rng.randrange(6)
        history = conversations.setdefault(c, [1 + c % 2])
        history.append(nxt)
        nxt += 1
        n = len(history) * 512 - rng.randrange(0, 400)
        rows.append(
            {
                "timestamp": t,
                "input_length": n,
                "output_length": rng.randrange(4, 900),
                "hash_ids": list(history),
            }
        )
        if len(history) > 5:
            conversations.pop(c)
    return rows


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in trace_rows()))
    return path


@dataclasses.dataclass
class TokensOnly:
    """The same stream with the blocks stripped: the simulator takes its token path."""

    inner: MooncakeTraceWorkload
    name: str = "tokens-only"

    def requests(self) -> Iterator[RequestSpec]:
        for spec in self.inner.requests():
            yield dataclasses.replace(spec, prompt_blocks=None)


def fleet(policy: str, **kw) -> FleetConfig:
    return FleetConfig(
        num_replicas=3, model_preset="tiny-h100", policy=policy, kv_capacity_tokens=8192, seed=3, **kw
    )


# Figures of this run on the token path (token lists per request, keys hashed from them; see
# TokensOnly): replica per request, GPU and shared-tier hit tokens, Σ TTFT, last finish,
# preemptions, device-tier evictions. Block replay must reproduce them exactly.
BEFORE = {
    "random": ('101101202101112000021220000012201102', 26640, 0, 12.79457719613657, 3.6566142860428146, 19, 1088),
    "approximate": ('000000000000000000021212121222121121', 33824, 0, 6.67740420928458, 2.962920555663245, 11, 742),
    "load": ('021012021012010201202101210210000002', 26896, 0, 9.898213352924433, 3.021439153769748, 13, 943),
    "round-robin": ('012012012012012012012012012012012012', 22720, 16720, 16.505933459475827, 3.3026062177058155, 7, 1148),
}  # fmt: skip


def figures(run) -> tuple:
    reqs = run.requests
    assert all(r.failed is None for r in reqs)
    return (
        "".join(str(r.replica) for r in reqs),
        sum(r.hit_gpu for r in reqs),
        sum(r.hit_shared for r in reqs),
        sum(r.first_token - r.arrival for r in reqs),
        max(r.finish for r in reqs),
        sum(r.num_preemptions for r in reqs),
        sum(x.cache.num_evicted for x in run.replicas),
    )


@pytest.mark.parametrize("policy", sorted(BEFORE))
def test_block_replay_reproduces_the_token_paths_figures(trace, policy):
    shared = "redis" if policy == "round-robin" else None
    run = simulate(fleet(policy, shared_tier=shared), MooncakeTraceWorkload(trace, speedup=40.0))
    assert figures(run) == BEFORE[policy]
    applier = run.router.applier
    assert applier.stats.num_blocks_stored > 0 and applier.stats.num_orphans == 0


def test_block_and_token_paths_agree_request_by_request(trace):
    def rows(workload):
        run = simulate(fleet("approximate", cpu_tier_tokens=4096), workload)
        return [(r.replica, r.first_token, r.finish, r.hit_gpu, r.hit_cpu) for r in run.requests]

    blocks = MooncakeTraceWorkload(trace, speedup=40.0, cached_blocks=2)
    assert rows(blocks) == rows(TokensOnly(MooncakeTraceWorkload(trace, speedup=40.0)))


@pytest.mark.parametrize("block_size", [16, 64, 48])
def test_block_keys_are_the_keys_of_the_prompts_tokens(block_size):
    hasher = BlockHasher(Namespace("sim"), block_size, HashAlgo.XXH3)
    keys = PromptKeys(hasher, memo_blocks=3)
    source = BlockTokens(512, seed=2, vocab_size=32_000, token_low=100)
    prompts = [
        PromptBlocks((1, 2, 3), 1400, source),
        PromptBlocks((1, 2), 1024, source),
        PromptBlocks((1, 5), 530, source),
        PromptBlocks((7,), 10, source),
        PromptBlocks((1, 2, 3), 1400, source),
    ]
    for p in prompts:
        assert keys.block_keys(p) == hasher.hash_blocks(p.token_ids())
    # 16: blocks 1, 2, 3 of the first prompt; 5 (530 tokens reach one 16-token block of it); 3
    # again, dropped from the memo of three by 5. 64: 5 keys no block, so 3 is still memoised.
    assert keys.num_blocks_hashed == {16: 5, 64: 3, 48: 0}[block_size]


def test_report_puts_the_run_against_the_ideal_shared_cache(trace):
    rep = build_report(simulate(fleet("random"), MooncakeTraceWorkload(trace, speedup=40.0)))
    ideal = rep.ideal
    assert (ideal.capacity_tokens, ideal.block_size, ideal.num_requests) == (3 * 8192, 16, 36)
    assert (ideal.prompt_tokens, ideal.hit_tokens) == (61_240, 43_216)
    reusable = sum(s.reusable_prefix_len for s in MooncakeTraceWorkload(trace).requests())
    assert ideal.hit_tokens <= reusable
    assert rep.hit_rate_vs_ideal == pytest.approx(rep.tiers.rates()["total"] / ideal.hit_rate)
    out = rep.to_dict()
    assert out["ideal_shared_cache"]["hit_rate"] == pytest.approx(43_216 / 61_240)
    assert out["hit_rate_vs_ideal"] == pytest.approx(26_640 / 61_240 / (43_216 / 61_240))


def test_cli_replays_a_trace(trace, capsys):
    code = main([
        "sim", "--trace", str(trace), "--speedup", "40", "--max-requests", "20", "--replicas", "3",
        "--model-preset", "tiny-h100", "--kv-capacity-tokens", "8192", "--policies", "random,load", "--json",
    ])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"random", "load"}
    for run in out.values():
        assert run["summary"]["num_requests"] == 20
        assert run["ideal_shared_cache"]["num_requests"] == 20
        assert 0 < run["ideal_shared_cache"]["hit_rate"] < 1 and run["hit_rate_vs_ideal"] > 0


def test_cli_trace_errors(trace, tmp_path, capsys):
    wl = tmp_path / "w.yaml"
    wl.write_text("type: shared_prefix\nnum_groups: 1\nnum_prompts_per_group: 1\nsystem_prompt_len: 8\n"
                  "question_len: 8\noutput_len: 1\n")  # fmt: skip
    assert main(["sim", "--trace", str(trace), "--workload", str(wl), "--replicas", "2"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["sim", "--workload", str(wl), "--replicas", "2", "--speedup", "2"]) == 2
    assert "apply to --trace" in capsys.readouterr().err
    assert main(["sim", "--trace", str(tmp_path / "nope.jsonl"), "--replicas", "2"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_run_frees_the_fleet_an_earlier_run_left_behind(trace):
    first = FleetSimulation(fleet("random"))
    first.run(MooncakeTraceWorkload(trace, max_requests=5))
    gone = weakref.ref(first.replicas[0])
    del first
    second = FleetSimulation(fleet("random"))
    second.run(MooncakeTraceWorkload(trace, max_requests=5))
    assert gone() is None  # not kept next to the new fleet while the collector is paused
