"""Correctness with the real SmolLM2: reused KV must give the logits and tokens of a cold prefill.

Random weights cannot catch wrong-KV bugs (wrong positions, layers or heads swapped); a trained model's
greedy continuation diverges at once when the KV is wrong.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvmesh.engine.runner import PrefillChunk, SamplingParams, Sequence, StepPlan

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
SYSTEM = (
    "You are a meticulous assistant for a railway company. Timetables: the 07:10 from Lyon reaches "
    "Paris at 09:05; the 08:40 from Lyon reaches Paris at 10:41; the 12:15 from Marseille reaches Lyon "
    "at 13:55. Tickets can be changed free of charge until departure. Answer briefly and precisely."
)


@pytest.fixture(scope="module")
def prompt(smollm2_runner) -> list[int]:
    tok = smollm2_runner.tokenizer
    return tok.apply_chat_template(
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "When does the 08:40 train from Lyon arrive in Paris?"},
        ]
    )


@pytest.fixture(scope="module")
def cold(smollm2_runner, prompt, generate):
    return generate(smollm2_runner, prompt, 24, request_id="cold")


def test_cold_generation_is_sensible(smollm2_runner, cold) -> None:
    """The answer is about the question (a model fed wrong KV rambles or repeats)."""
    text = smollm2_runner.tokenizer.decode(cold[0])
    assert "Lyon" in text and "Paris" in text, text


def _prefix_kv(runner, prompt, num_cached):
    """KV of the first ``num_cached`` prompt tokens, computed by another sequence."""
    donor = Sequence("donor", list(prompt), len(prompt), SamplingParams())
    runner.execute_sync(StepPlan(prefills=[PrefillChunk(donor, 0, len(prompt))]))
    kv = runner.export_kv(donor, 0, num_cached)
    runner.free(donor)
    return kv


@pytest.mark.parametrize("num_cached", [16, 64, -1])
def test_prefix_reuse_matches_cold(smollm2_runner, prompt, cold, generate, num_cached) -> None:
    num_cached = len(prompt) - 1 if num_cached < 0 else num_cached
    kv = _prefix_kv(smollm2_runner, prompt, num_cached)
    layout = smollm2_runner.info.kv
    assert kv.shape == (layout.num_layers, 2, layout.num_kv_heads, num_cached, layout.head_dim)
    tokens, logits = generate(smollm2_runner, prompt, 24, request_id="warm", cached_kv=kv, cached=num_cached)
    cold_tokens, cold_logits = cold
    assert np.abs(logits[0] - cold_logits[0]).max() <= TOLERANCE
    assert tokens == cold_tokens


def test_kv_through_bytes_round_trip(smollm2_runner, prompt, cold, generate) -> None:
    """The store hands back read-only arrays over received bytes; they must work unchanged."""
    num_cached = 48
    kv = _prefix_kv(smollm2_runner, prompt, num_cached)
    payload = kv.tobytes()
    restored = np.frombuffer(payload, dtype=kv.dtype).reshape(kv.shape)
    assert not restored.flags.writeable
    tokens, logits = generate(
        smollm2_runner, prompt, 4, request_id="bytes", cached_kv=restored, cached=num_cached
    )
    assert np.abs(logits[0] - cold[1][0]).max() <= TOLERANCE
    assert tokens == cold[0][:4]


def test_whole_prompt_cached_is_trimmed(smollm2_runner, prompt, cold, generate) -> None:
    """A hit covering the entire prompt still yields first-token logits (last token recomputed)."""
    donor = Sequence("donor", list(prompt), len(prompt), SamplingParams())
    smollm2_runner.execute_sync(StepPlan(prefills=[PrefillChunk(donor, 0, len(prompt))]))
    kv = smollm2_runner.export_kv(donor, 0, len(prompt))
    smollm2_runner.free(donor)
    seq = Sequence("full", list(prompt), len(prompt), SamplingParams())
    out = smollm2_runner.execute_sync(
        StepPlan(prefills=[PrefillChunk(seq, len(prompt), len(prompt), cached_kv=kv)])
    )
    assert seq.num_computed_tokens == len(prompt)
    assert out.sampled["full"] == cold[0][0]
    assert np.abs(out.last_logits["full"] - cold[1][0]).max() <= TOLERANCE


def test_chunked_prefill_matches_one_shot(smollm2_runner, prompt, cold, generate) -> None:
    tokens, logits = generate(smollm2_runner, prompt, 8, request_id="chunked", chunk=37)
    assert np.abs(logits[0] - cold[1][0]).max() <= TOLERANCE
    assert tokens == cold[0][:8]


def test_chunked_prefill_after_cached_prefix(smollm2_runner, prompt, cold, generate) -> None:
    kv = _prefix_kv(smollm2_runner, prompt, 32)
    tokens, logits = generate(smollm2_runner, prompt, 4, request_id="mix", cached_kv=kv, cached=32, chunk=25)
    assert np.abs(logits[0] - cold[1][0]).max() <= TOLERANCE
    assert tokens == cold[0][:4]


def test_exported_kv_equals_cold_kv(smollm2_runner, prompt) -> None:
    """KV computed after a reused prefix equals the KV a cold prefill computes for the same tokens."""
    cold_seq = Sequence("a", list(prompt), len(prompt), SamplingParams())
    smollm2_runner.execute_sync(StepPlan(prefills=[PrefillChunk(cold_seq, 0, len(prompt))]))
    prefix = smollm2_runner.export_kv(cold_seq, 0, 40)
    warm_seq = Sequence("b", list(prompt), len(prompt), SamplingParams())
    smollm2_runner.execute_sync(
        StepPlan(prefills=[PrefillChunk(warm_seq, 40, len(prompt), cached_kv=prefix)])
    )
    a = smollm2_runner.export_kv(cold_seq, 40, len(prompt))
    b = smollm2_runner.export_kv(warm_seq, 40, len(prompt))
    np.testing.assert_array_equal(smollm2_runner.export_kv(warm_seq, 0, 40), prefix)
    assert np.abs(a - b).max() <= TOLERANCE
    smollm2_runner.free(cold_seq)
    smollm2_runner.free(warm_seq)


def test_seeded_sampling_is_reproducible(smollm2_runner, prompt, generate) -> None:
    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=seed)

    first, _ = generate(smollm2_runner, prompt, 8, request_id="s1", sampling=params(1234))
    kv = _prefix_kv(smollm2_runner, prompt, 50)
    again, _ = generate(
        smollm2_runner, prompt, 8, request_id="s2", sampling=params(1234), cached_kv=kv, cached=50
    )
    others = [generate(smollm2_runner, prompt, 8, request_id="s3", sampling=params(s))[0] for s in (1, 2, 3)]
    assert first == again
    assert any(o != first for o in others)


async def test_batched_step_matches_single_runs(smollm2_runner, prompt, cold) -> None:
    """One step mixing a prefill and decodes of other sequences, run through the async API."""
    other = smollm2_runner.tokenizer.apply_chat_template([{"role": "user", "content": "Name a color."}])
    a = Sequence("a", list(prompt), len(prompt), SamplingParams())
    b = Sequence("b", list(other), len(other), SamplingParams())
    out = await smollm2_runner.execute(StepPlan(prefills=[PrefillChunk(a, 0, len(prompt))]))
    a.token_ids.append(out.sampled["a"])
    tokens_a = [out.sampled["a"]]
    out = await smollm2_runner.execute(StepPlan(prefills=[PrefillChunk(b, 0, len(other))], decodes=[a]))
    assert set(out.sampled) == {"a", "b"}
    tokens_a.append(out.sampled["a"])
    a.token_ids.append(out.sampled["a"])
    b.token_ids.append(out.sampled["b"])
    results = await asyncio.gather(smollm2_runner.execute(StepPlan(decodes=[a, b])))
    tokens_a.append(results[0].sampled["a"])
    assert tokens_a == cold[0][:3]
    assert a.num_computed_tokens == len(a.token_ids) and b.num_computed_tokens == len(b.token_ids)
    smollm2_runner.free(a)
    smollm2_runner.free(b)


def test_wrong_kv_is_caught(smollm2_runner, prompt, cold) -> None:
    """The tolerance is meaningful: KV with its layers out of order moves the logits far beyond it."""
    kv = _prefix_kv(smollm2_runner, prompt, 64)
    seq = Sequence("wrong", list(prompt), len(prompt), SamplingParams())
    out = smollm2_runner.execute_sync(
        StepPlan(prefills=[PrefillChunk(seq, 64, len(prompt), cached_kv=kv[::-1].copy())])
    )
    smollm2_runner.free(seq)
    assert np.abs(out.last_logits["wrong"] - cold[1][0]).max() > 100 * TOLERANCE


def test_batched_decodes_match_sequential(smollm2_runner, prompt, generate) -> None:
    """Sequences of different lengths decoded as one padded batch give their solo tokens and logits."""
    tok = smollm2_runner.tokenizer
    prompts = [
        prompt,
        tok.apply_chat_template([{"role": "user", "content": "Name three colors."}]),
        tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea and the wind."}]),
    ]
    solo = [generate(smollm2_runner, p, 6, request_id=f"solo{i}") for i, p in enumerate(prompts)]
    seqs = [Sequence(f"b{i}", list(p), len(p), SamplingParams()) for i, p in enumerate(prompts)]
    out = smollm2_runner.execute_sync(StepPlan(prefills=[PrefillChunk(s, 0, len(s.token_ids)) for s in seqs]))
    tokens = {s.request_id: [out.sampled[s.request_id]] for s in seqs}
    logits = {s.request_id: [out.last_logits[s.request_id]] for s in seqs}
    for _ in range(5):
        for s in seqs:
            s.token_ids.append(tokens[s.request_id][-1])
        out = smollm2_runner.execute_sync(StepPlan(decodes=seqs))
        for s in seqs:
            tokens[s.request_id].append(out.sampled[s.request_id])
            logits[s.request_id].append(out.last_logits[s.request_id])
    for i, s in enumerate(seqs):
        assert tokens[s.request_id] == solo[i][0]
        for a, b in zip(logits[s.request_id], solo[i][1], strict=True):
            assert np.abs(a - b).max() <= TOLERANCE
        assert s.num_computed_tokens == len(s.token_ids)
        smollm2_runner.free(s)
