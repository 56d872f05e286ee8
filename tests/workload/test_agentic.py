"""Coding-agent sessions: growing contexts as block chains, think times, compaction and truncation."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmesh.sim
from kvmesh.errors import ConfigError
from kvmesh.workload import AgenticWorkload, BlockWorkload, RequestSpec, load_workload

EXAMPLE = Path(kvmesh.sim.__file__).parent / "examples" / "agentic.yaml"


def small(**kw) -> AgenticWorkload:
    params: dict = dict(
        num_sessions=6,
        system_prompt_len=100,  # rounded up to 2 blocks of 64
        task_len={"median": 80, "sigma": 0.5, "min": 10, "max": 300},
        num_turns={"median": 8, "sigma": 0.5, "min": 3, "max": 20},
        output_len={"median": 12, "sigma": 0.5, "min": 1, "max": 60},
        tool_result_len={"median": 40, "sigma": 1.2, "min": 1, "max": 400},
        think_time_s={"median": 0.5, "sigma": 1.0, "min": 0.01, "max": 10},
        max_context_tokens=1024,
        summary_len={"mean": 150, "std_dev": 30, "min": 20, "max": 300},
        block_tokens=64,
        seed=5,
    )
    params.update(kw)
    return AgenticWorkload(**params)


SYSTEM = 128  # small()'s system prompt in whole blocks


def _key(spec: RequestSpec) -> tuple:
    assert spec.prompt_blocks is not None
    return (
        spec.request_id,
        spec.arrival_s,
        spec.output_len,
        spec.session_id,
        spec.reusable_prefix_len,
        spec.gap_after_previous_s,
        spec.prompt_blocks.hash_ids,
        spec.prompt_blocks.num_tokens,
    )


def _by_session(specs: list[RequestSpec]) -> dict[str, list[RequestSpec]]:
    sessions: dict[str, list[RequestSpec]] = {}
    for s in specs:
        assert s.session_id is not None
        sessions.setdefault(s.session_id, []).append(s)
    return sessions


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_same_seed_same_stream_and_a_new_seed_another():
    w = small()
    assert isinstance(w, BlockWorkload)
    first = [_key(s) for s in w.block_requests()]
    assert first == [_key(s) for s in small().block_requests()]
    assert first != [_key(s) for s in small(seed=6).block_requests()]


def test_requests_match_block_requests_token_for_token():
    w = small(num_agent_kinds=2)
    blocks = list(w.block_requests())
    for spec, full in zip(blocks, w.requests(), strict=True):
        assert spec.prompt_token_ids == []
        assert spec.prompt_blocks is not None
        assert full.prompt_token_ids == spec.prompt_blocks.token_ids()
        assert len(full.prompt_token_ids) == spec.prompt_blocks.num_tokens
        assert _key(spec) == _key(full)


def test_block_requests_draw_no_tokens():
    specs = list(small(num_sessions=20).block_requests())
    assert specs and all(s.prompt_token_ids == [] for s in specs)
    assert specs[0].prompt_blocks is not None
    assert specs[0].prompt_blocks.source.num_drawn == 0  # tokens are drawn only when a consumer reads them


def test_each_turn_extends_the_previous_prompt_until_the_cap():
    w = small(max_context_tokens=100_000)  # no cap reached
    specs = list(w.requests())
    for turns in _by_session(specs).values():
        assert turns[0].gap_after_previous_s is None
        for prev, cur in itertools.pairwise(turns):
            assert cur.prompt_token_ids[: len(prev.prompt_token_ids)] == prev.prompt_token_ids
            # the model's output and a tool result were appended
            assert len(cur.prompt_token_ids) >= len(prev.prompt_token_ids) + prev.output_len + 1
            assert cur.reusable_prefix_len == len(prev.prompt_token_ids)
            assert cur.gap_after_previous_s is not None and cur.gap_after_previous_s > 0
            assert cur.arrival_s == pytest.approx(prev.arrival_s + cur.gap_after_previous_s)
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)


def test_sessions_share_exactly_their_kinds_system_prompt():
    w = small(num_sessions=12, num_agent_kinds=2, system_prompt_len=130)  # 3 blocks of 64
    specs = list(w.requests())
    firsts = [s for s in specs if s.gap_after_previous_s is None]
    assert len(firsts) == 12
    systems = {tuple(s.prompt_token_ids[:192]) for s in firsts}
    assert len(systems) == 2  # one per agent kind
    first_of_kind: set[tuple[int, ...]] = set()
    for s in firsts:
        system = tuple(s.prompt_token_ids[:192])
        assert s.reusable_prefix_len == (192 if system in first_of_kind else 0)
        first_of_kind.add(system)
    # beyond the system prompt, sessions have nothing in common
    for a, b in itertools.combinations(firsts, 2):
        assert _common_prefix(a.prompt_token_ids, b.prompt_token_ids) <= 193


def test_reusable_prefix_is_what_earlier_prompts_share():
    specs = list(small(num_agent_kinds=2, on_cap="truncate").requests())
    for i, s in enumerate(specs):
        longest = max((_common_prefix(s.prompt_token_ids, e.prompt_token_ids) for e in specs[:i]), default=0)
        # random tokens may agree by chance for a token past the shared part
        assert s.reusable_prefix_len <= longest <= s.reusable_prefix_len + 2


def _cap_events(specs: list[RequestSpec]) -> list[tuple[RequestSpec, RequestSpec]]:
    return [
        (prev, cur)
        for turns in _by_session(specs).values()
        for prev, cur in itertools.pairwise(turns)
        if cur.reusable_prefix_len != len(prev.prompt_token_ids)
    ]


def test_compaction_keeps_the_system_prompt_and_starts_a_fresh_summary():
    w = small(max_context_tokens=600)
    specs = list(w.requests())
    events = _cap_events(specs)
    assert len(events) >= 3
    for s in specs:
        assert len(s.prompt_token_ids) <= 600
    for prev, cur in events:
        assert prev.prompt_blocks is not None and cur.prompt_blocks is not None
        assert cur.reusable_prefix_len == SYSTEM
        assert cur.prompt_token_ids[:SYSTEM] == prev.prompt_token_ids[:SYSTEM]
        summary = cur.prompt_blocks.hash_ids[2:]
        assert summary and not set(summary) & set(prev.prompt_blocks.hash_ids)  # new blocks
        assert 20 <= len(cur.prompt_token_ids) - SYSTEM <= 300  # the summary's length
        # the history would not have fitted: previous prompt + its output + a tool result (<= 400)
        assert len(prev.prompt_token_ids) + prev.output_len + 400 > 600


def test_truncation_drops_the_oldest_blocks_after_the_system_prompt():
    w = small(max_context_tokens=600, on_cap="truncate", truncate_to=0.5)
    specs = list(w.requests())
    events = _cap_events(specs)
    assert len(events) >= 3
    for prev, cur in events:
        assert prev.prompt_blocks is not None and cur.prompt_blocks is not None
        assert cur.reusable_prefix_len == SYSTEM
        assert len(cur.prompt_token_ids) <= 300
        assert cur.prompt_blocks.hash_ids[:2] == prev.prompt_blocks.hash_ids[:2]
        kept = cur.prompt_blocks.hash_ids[2:]
        before = prev.prompt_blocks.hash_ids
        if kept[0] in before:  # the newest whole blocks of the history stay, in order
            start = before.index(kept[0])
            assert start > 2
            overlap = before[start:]
            assert kept[: len(overlap)] == overlap
            # their tokens too: a cut at a block boundary keeps the blocks' tokens
            tail = prev.prompt_token_ids[start * 64 :]
            assert cur.prompt_token_ids[SYSTEM : SYSTEM + len(tail)] == tail


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    lo=st.integers(1, 12),
    span=st.integers(0, 30),
    on_cap=st.sampled_from(["compact", "truncate"]),
)
def test_turn_counts_and_context_stay_within_bounds(seed, lo, span, on_cap):
    hi = lo + span
    w = small(
        num_sessions=4,
        seed=seed,
        num_turns={"median": lo + span / 2 + 1, "sigma": 1.0, "min": lo, "max": hi},
        on_cap=on_cap,
        max_context_tokens=700,
    )
    sessions = _by_session(list(w.block_requests()))
    assert len(sessions) == 4
    for turns in sessions.values():
        assert lo <= len(turns) <= hi
        assert [t.request_id.rsplit("-t", 1)[1] for t in turns] == [str(k) for k in range(len(turns))]
        for t in turns:
            assert t.prompt_blocks is not None
            assert SYSTEM < t.prompt_blocks.num_tokens <= 700
            assert len(t.prompt_blocks.hash_ids) == -(-t.prompt_blocks.num_tokens // 64)


def test_session_starts_follow_the_interval_or_rate():
    constant = small(num_sessions=5, num_turns=3, arrival="constant", session_rate=2.0)
    starts = [s.arrival_s for s in constant.block_requests() if s.gap_after_previous_s is None]
    assert starts == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    poisson = small(num_sessions=400, num_turns=1, session_interval_s=3.0)
    times = [s.arrival_s for s in poisson.block_requests()]
    assert 2.5 < times[-1] / 399 < 3.5


def test_yaml_loads_an_agentic_workload():
    w = load_workload(
        """
type: agentic
num_sessions: 3
session_rate: 0.5
num_agent_kinds: 2
output_len: {mean: 20, std_dev: 5, min: 1, max: 40}
tool_result_len: {median: 30, sigma: 1.0, max: 200}
num_turns: 4
on_cap: truncate
block_tokens: 64
"""
    )
    assert isinstance(w, AgenticWorkload)
    specs = list(w.block_requests())
    assert len(specs) == 12
    assert all(1 <= s.output_len <= 40 for s in specs)
    assert dataclasses.replace(w, seed=1).seed == 1


def test_the_example_stream_is_long_and_mostly_seen_before():
    w = load_workload(EXAMPLE)
    assert isinstance(w, AgenticWorkload)
    specs = list(w.block_requests())
    prompt = [s.prompt_blocks.num_tokens for s in specs if s.prompt_blocks is not None]
    assert 3000 < len(specs) < 6000
    assert 60_000 < sum(prompt) / len(prompt) < 90_000
    assert max(prompt) <= w.max_context_tokens
    reusable = sum(s.reusable_prefix_len for s in specs) / sum(prompt)
    assert 0.93 < reusable < 0.98


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"num_sessions": 0}, "num_sessions"),
        ({"session_interval_s": 2.0, "session_rate": 1.0}, "not both"),
        ({"session_rate": 0.0}, "session_rate > 0"),
        ({"on_cap": "drop"}, "on_cap"),
        ({"arrival": "bursty"}, "arrival"),
        ({"truncate_to": 0.0}, "truncate_to"),
        ({"num_agent_kinds": 0}, "num_agent_kinds"),
        ({"output_len": {"median": 10, "std_dev": 3}}, "output_len: expected"),
        ({"tool_result_len": {"median": 0, "sigma": 1}}, "tool_result_len: need median > 0"),
        ({"think_time_s": -1}, "think_time_s must be >= 0"),
        ({"num_turns": "many"}, "num_turns: expected"),
        ({"task_len": {"mean": 10, "min": 20, "max": 5}}, "task_len: need"),
        ({"system_prompt_len": 2000, "max_context_tokens": 2048}, "must leave room"),
        ({"system_prompt_len": {"median": 500, "sigma": 1}}, "must leave room"),
        ({"on_cap": "truncate", "truncate_to": 0.1}, "truncate_to=0.1"),
    ],
)
def test_bad_parameters_are_config_errors_that_name_them(params, message):
    with pytest.raises(ConfigError, match=message):
        small(**params)


def test_unknown_yaml_fields_are_config_errors():
    with pytest.raises(ConfigError, match="agentic workload"):
        load_workload({"type": "agentic", "num_session": 3})
