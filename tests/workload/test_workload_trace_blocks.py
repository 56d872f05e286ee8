"""Trace token blocks: drawn in bulk exactly as one randrange per token, shared, bounded."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.errors import ConfigError
from kvmesh.workload import (
    BlockTokens,
    BlockWorkload,
    MooncakeTraceWorkload,
    PromptBlocks,
    block_token_array,
    shifted,
    synthetic_tokens,
)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    hash_id=st.integers(0, 10**9),
    n=st.integers(0, 2000),
    token_low=st.integers(0, 300),
    span=st.one_of(st.integers(1, 70_000), st.sampled_from([2, 1024, 1025, 2**16, 2**31, 2**32 - 301])),
)
def test_bulk_draw_equals_one_randrange_per_token(seed, hash_id, n, token_low, span):
    vocab = token_low + span
    expected = synthetic_tokens(random.Random(f"{seed}:{hash_id}"), n, vocab, token_low)
    assert block_token_array(seed, hash_id, n, vocab, token_low).tolist() == expected


def test_bulk_draw_past_32_bit_ids_falls_back_to_randrange():
    expected = synthetic_tokens(random.Random("3:9"), 50, 2**40, 7)
    assert block_token_array(3, 9, 50, 2**40, 7).tolist() == expected


def test_blocks_are_shared_bounded_and_redrawn_equal():
    source = BlockTokens(64, seed=1, vocab_size=32_000, token_low=100, capacity_blocks=2)
    a = source.block(10)
    assert source.block(10) is a  # one list per block, shared by every prompt using it
    assert a == synthetic_tokens(random.Random("1:10"), 64, 32_000, 100)
    source.block(11)
    source.block(10)  # 10 is the most recent again: 11 goes next
    source.block(12)
    assert len(source) == 2 and source.num_drawn == 3
    assert source.block(11) == synthetic_tokens(random.Random("1:11"), 64, 32_000, 100)
    assert source.num_drawn == 4
    objects: dict[int, int] = {}
    for h in range(40):
        for t in source.block(h):
            assert id(t) == objects.setdefault(t, id(t))  # one int object per token id


def test_prompt_blocks_cut_to_the_prompt_length():
    source = BlockTokens(8, seed=0, vocab_size=500, token_low=100)
    prompt = PromptBlocks((4, 5, 6), 19, source)
    tokens = source.block(4) + source.block(5) + source.block(6)[:3]
    assert len(prompt) == 19 and prompt.token_ids() == tokens == list(prompt)
    for lo, hi in [(0, 19), (3, 11), (8, 16), (16, 19), (5, 5), (18, 40), (-4, None), (12, 2)]:
        assert prompt[lo:hi] == tokens[lo:hi]
    assert prompt[::3] == tokens[::3]
    assert [prompt[i] for i in (0, 7, 8, 18, -1, -19)] == [tokens[i] for i in (0, 7, 8, 18, -1, -19)]
    with pytest.raises(IndexError):
        prompt[19]
    with pytest.raises(ValueError, match="not inside"):
        source.tokens((4,), 0, 9)
    assert source.block_array(5).tolist() == source.block(5) and not source.block_array(5).flags.writeable
    with pytest.raises(ConfigError):
        BlockTokens(8, vocab_size=100, token_low=100)


def _trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_requests_carry_their_blocks_and_tokens_alike(tmp_path):
    trace = _trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 10, "input_length": 700, "output_length": 5, "hash_ids": [1, 4]},
        ],
    )
    workload = MooncakeTraceWorkload(trace, cached_blocks=1)
    specs = list(workload.requests())
    blocks_only = list(workload.block_requests())
    assert isinstance(workload, BlockWorkload)
    assert [s.prompt_token_ids for s in blocks_only] == [[], []]
    assert [s.prompt_blocks.token_ids() for s in blocks_only] == [s.prompt_token_ids for s in specs]
    assert [(s.request_id, s.arrival_s, s.reusable_prefix_len) for s in blocks_only] == [
        (s.request_id, s.arrival_s, s.reusable_prefix_len) for s in specs
    ]
    first, second = specs
    assert first.prompt_blocks is not None and second.prompt_blocks is not None
    assert first.prompt_blocks.hash_ids == (1, 2, 3) and second.prompt_blocks.hash_ids == (1, 4)
    assert [s.prompt_blocks.token_ids() for s in specs] == [s.prompt_token_ids for s in specs]
    assert first.prompt_token_ids[:512] == second.prompt_token_ids[:512]
    assert second.reusable_prefix_len == 512
    capped = list(MooncakeTraceWorkload(trace, max_input_len=600).requests())
    assert capped[0].prompt_blocks.hash_ids == (1, 2) and len(capped[0].prompt_token_ids) == 600


def test_shifted_trace_drops_blocks_that_no_longer_match_its_tokens(tmp_path):
    trace = _trace(
        tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}]
    )
    wrapped = shifted(MooncakeTraceWorkload(trace), 7)
    (spec,) = wrapped.requests()
    assert spec.prompt_blocks is None and len(spec.prompt_token_ids) == 600
    assert not isinstance(wrapped, BlockWorkload)
