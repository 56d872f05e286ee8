"""Workload streams: determinism, inference-perf cycling, reusable-prefix bookkeeping, trace replay."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.errors import ConfigError
from kvmesh.workload import (
    LengthDist,
    MooncakeTraceWorkload,
    MultiTurnWorkload,
    SharedPrefixWorkload,
    Stage,
    load_workload,
    stage_arrivals,
)


def _longest_shared_prefix(tokens: list[int], earlier: list[list[int]]) -> int:
    best = 0
    for other in earlier:
        n = 0
        for a, b in zip(tokens, other, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


@settings(max_examples=30, deadline=None)
@given(
    groups=st.integers(1, 5),
    per_group=st.integers(1, 4),
    sys_len=st.integers(1, 40),
    q_len=st.integers(1, 10),
    cycles=st.integers(1, 3),
    seed=st.integers(0, 1000),
)
def test_shared_prefix_cycles_prompts_and_counts_reusable_tokens(
    groups, per_group, sys_len, q_len, cycles, seed
):
    w = SharedPrefixWorkload(
        groups, per_group, sys_len, q_len, 4, num_requests=groups * per_group * cycles, seed=seed
    )
    specs = list(w.requests())
    n = groups * per_group
    assert len(specs) == n * cycles
    first_cycle = [tuple(s.prompt_token_ids) for s in specs[:n]]
    # every prompt exactly once per cycle, in the same (shuffled-once) order every cycle
    assert len(set(first_cycle)) == n
    for c in range(1, cycles):
        assert [tuple(s.prompt_token_ids) for s in specs[c * n : (c + 1) * n]] == first_cycle
    for i, s in enumerate(specs):
        assert len(s.prompt_token_ids) == sys_len + q_len
        # random tokens may agree by chance for a token or two past the system prompt: an upper bound
        lsp = _longest_shared_prefix(s.prompt_token_ids, [x.prompt_token_ids for x in specs[:i]])
        assert s.reusable_prefix_len <= lsp
        assert s.reusable_prefix_len in (0, sys_len, sys_len + q_len)
        if i >= n:
            assert s.reusable_prefix_len == sys_len + q_len
    assert list(w.requests()) == specs


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    w = SharedPrefixWorkload(3, 4, 64, 16, 8, seed=7)
    by_group: dict[str, list[list[int]]] = {}
    for s in w.requests():
        assert s.group is not None
        by_group.setdefault(s.group, []).append(s.prompt_token_ids)
    assert len(by_group) == 3
    systems = {g: p[0][:64] for g, p in by_group.items()}
    for g, prompts in by_group.items():
        assert all(p[:64] == systems[g] for p in prompts)
    assert len({tuple(v) for v in systems.values()}) == 3


@settings(max_examples=25, deadline=None)
@given(
    rates=st.lists(st.tuples(st.floats(0.5, 50), st.floats(0.5, 5)), min_size=1, max_size=4),
    arrival=st.sampled_from(["poisson", "constant"]),
    seed=st.integers(0, 100),
)
def test_stage_arrivals_are_sorted_and_inside_their_stage(rates, arrival, seed):
    import random

    stages = [Stage(r, d) for r, d in rates]
    out = list(stage_arrivals(stages, arrival, random.Random(seed)))
    times = [t for t, _ in out]
    assert times == sorted(times)
    starts = [sum(s.duration for s in stages[:i]) for i in range(len(stages))]
    for t, k in out:
        assert starts[k] <= t < starts[k] + stages[k].duration
    if arrival == "constant":
        for k, st_ in enumerate(stages):
            count = sum(1 for _, j in out if j == k)
            assert abs(count - st_.rate * st_.duration) <= 1


def test_poisson_stage_mean_rate():
    import random

    out = list(stage_arrivals([Stage(20, 200)], "poisson", random.Random(1)))
    assert 3600 < len(out) < 4400


@settings(max_examples=40, deadline=None)
@given(
    mean=st.integers(0, 500),
    std=st.integers(0, 100),
    lo=st.integers(0, 200),
    span=st.integers(0, 400),
    seed=st.integers(0, 50),
)
def test_length_distribution_stays_in_bounds(mean, std, lo, span, seed):
    import random

    d = LengthDist.parse({"mean": mean, "std_dev": std, "min": lo, "max": lo + span})
    rng = random.Random(seed)
    for _ in range(20):
        assert lo <= d.sample(rng) <= lo + span


@pytest.mark.parametrize(
    "bad",
    [-1, {"mean": 5, "std_dev": -1}, {"mean": 5, "min": 10, "max": 3}, {"avg": 3}, "ten", True],
)
def test_length_distribution_rejects_bad_specs(bad):
    with pytest.raises(ConfigError):
        LengthDist.parse(bad)


def test_multi_turn_history_grows_and_sessions_are_ordered():
    w = MultiTurnWorkload(
        num_conversations=3, num_turns=4, tokens_per_turn=20, output_len=5, system_prompt_len=10
    )
    specs = list(w.requests())
    assert len(specs) == 12
    for c in range(3):
        turns = [s for s in specs if s.session_id == f"c{c}"]
        assert [s.stage for s in turns] == [0, 1, 2, 3]
        assert turns[0].reusable_prefix_len == 0
        for prev, cur in itertools.pairwise(turns):
            assert cur.prompt_token_ids[: len(prev.prompt_token_ids)] == prev.prompt_token_ids
            assert cur.reusable_prefix_len == len(prev.prompt_token_ids)
            assert len(cur.prompt_token_ids) == len(prev.prompt_token_ids) + 5 + 20
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)


def test_multi_turn_text_mode_builds_chat_history():
    w = MultiTurnWorkload(num_conversations=1, num_turns=3, tokens_per_turn=6, output_len=4, text=True)
    specs = list(w.requests())
    assert [len(s.messages or []) for s in specs] == [1, 3, 5]
    assert [m["role"] for m in specs[2].messages or []] == ["user", "assistant", "user", "assistant", "user"]
    assert specs[2].messages[:3] == specs[1].messages  # type: ignore[index]


def _write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_mooncake_replay_maps_hash_ids_to_stable_blocks(tmp_path):
    trace = _write_trace(
        tmp_path / "trace.jsonl",
        [
            {"timestamp": 1000, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
            {"timestamp": 1500, "input_length": 1024, "output_length": 12, "hash_ids": [1, 2]},
            {"timestamp": 3000, "input_length": 700, "output_length": 5, "hash_ids": [1, 4]},
            {"timestamp": 4000, "input_length": 1300, "output_length": 5, "hash_ids": [1, 2, 3]},
        ],
    )
    w = MooncakeTraceWorkload(trace, speedup=2.0)
    specs = list(w.requests())
    assert [len(s.prompt_token_ids) for s in specs] == [1200, 1024, 700, 1300]
    assert [s.arrival_s for s in specs] == [0.0, 0.25, 1.0, 1.5]
    assert [s.output_len for s in specs] == [10, 12, 5, 5]
    assert specs[1].prompt_token_ids == specs[0].prompt_token_ids[:1024]
    assert specs[2].prompt_token_ids[:512] == specs[0].prompt_token_ids[:512]
    assert specs[2].prompt_token_ids[512:] != specs[0].prompt_token_ids[512:700]
    # block 3 was seen with 176 tokens, so only those are reusable in the last request
    assert [s.reusable_prefix_len for s in specs] == [0, 1024, 512, 1200]
    assert [s.prompt_token_ids for s in MooncakeTraceWorkload(trace, speedup=2.0).requests()] == [
        s.prompt_token_ids for s in specs
    ]
    assert len(list(MooncakeTraceWorkload(trace, max_requests=2).requests())) == 2


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        json.dumps({"timestamp": 0, "input_length": 10}),
        json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}),
        json.dumps({"timestamp": "x", "input_length": 1, "output_length": 1, "hash_ids": [1]}),
    ],
)
def test_mooncake_rejects_malformed_lines_with_line_number(tmp_path, line):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [9]}) + "\n" + line
    )
    with pytest.raises(ConfigError, match=":2:"):
        list(MooncakeTraceWorkload(trace).requests())


def test_load_workload_accepts_inference_perf_layout():
    cfg = """
load:
  type: constant
  stages:
    - {rate: 4, duration: 2, warmup: true}
    - {rate: 8, duration: 1}
data:
  type: shared_prefix
  shared_prefix:
    num_groups: 2
    num_prompts_per_group: 3
    system_prompt_len: 32
    question_len: {mean: 8, std_dev: 2, min: 4, max: 12}
    output_len: 5
"""
    w = load_workload(cfg)
    assert isinstance(w, SharedPrefixWorkload)
    specs = list(w.requests())
    assert [s.stage for s in specs].count(0) == 7
    assert [s.stage for s in specs].count(1) == 7
    assert w.stages is not None and [st.warmup for st in w.stages] == [True, False]
    assert all(36 <= len(s.prompt_token_ids) <= 44 for s in specs)


def test_load_workload_flat_layout_and_errors(tmp_path):
    w = load_workload(
        {"type": "multi_turn", "num_conversations": 2, "num_turns": 2, "tokens_per_turn": 8, "output_len": 2}
    )
    assert isinstance(w, MultiTurnWorkload)
    f = tmp_path / "w.yaml"
    f.write_text("type: mooncake\npath: trace.jsonl\nspeedup: 3\n")
    assert isinstance(load_workload(f), MooncakeTraceWorkload)
    with pytest.raises(ConfigError, match="unknown workload type"):
        load_workload({"type": "nope"})
    with pytest.raises(ConfigError, match="shared_prefix"):
        load_workload({"type": "shared_prefix", "num_groups": 1})
    tiny = {
        "type": "shared_prefix",
        "num_groups": 1,
        "num_prompts_per_group": 1,
        "system_prompt_len": 1,
        "question_len": 1,
        "output_len": 1,
    }
    with pytest.raises(ConfigError, match="stage"):
        load_workload({**tiny, "stages": [{"rate": 0, "duration": 1}]})
    with pytest.raises(ConfigError, match="warmup"):
        load_workload({**tiny, "stages": [{"rate": 1, "duration": 1, "warmup": "yes"}]})
    with pytest.raises(ConfigError, match="mapping"):
        load_workload("- a\n- b\n")


def test_shifted_tokens_keep_structure_and_share_no_token():
    from kvmesh.workload import shifted

    base = SharedPrefixWorkload(3, 2, 40, 8, 4, stages=[Stage(5, 2)], vocab_size=500, token_low=100)
    a = list(base.requests())
    b = list(shifted(base, 7919).requests())
    assert shifted(base, 0) is base
    assert [(s.arrival_s, s.group, s.reusable_prefix_len, len(s.prompt_token_ids)) for s in a] == [
        (s.arrival_s, s.group, s.reusable_prefix_len, len(s.prompt_token_ids)) for s in b
    ]
    for x, y in zip(a, b, strict=True):
        assert all(100 <= t < 500 for t in y.prompt_token_ids)
        assert all(p != q for p, q in zip(x.prompt_token_ids, y.prompt_token_ids, strict=True))
    # sharing inside the shifted stream is preserved exactly
    groups: dict[str | None, list[int]] = {}
    for s in b:
        first = groups.setdefault(s.group, s.prompt_token_ids)
        assert s.prompt_token_ids[:40] == first[:40]


def test_mooncake_reads_gzip_traces_and_rejects_a_corrupt_one(tmp_path):
    import gzip

    rows = [{"timestamp": t, "input_length": 600, "output_length": 2, "hash_ids": [7, t]} for t in (0, 5)]
    plain = tmp_path / "t.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    a = list(MooncakeTraceWorkload(plain).requests())
    b = list(MooncakeTraceWorkload(packed).requests())
    assert [s.prompt_token_ids for s in a] == [s.prompt_token_ids for s in b]
    assert b[1].reusable_prefix_len == 512  # hash id 7 is shared
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(packed.read_bytes()[:-12])
    with pytest.raises(ConfigError, match="unreadable trace"):
        list(MooncakeTraceWorkload(broken).requests())


def test_bundled_mooncake_traces_parse():
    from pathlib import Path

    traces = Path(__file__).resolve().parents[2] / "benchmarks" / "traces"
    synthetic = MooncakeTraceWorkload(traces / "mooncake_synthetic_trace.jsonl.gz", max_requests=50)
    specs = list(synthetic.requests())
    assert len(specs) == 50
    assert any(s.reusable_prefix_len > 0 for s in specs)
