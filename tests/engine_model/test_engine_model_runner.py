"""TorchRunner protocol behaviour on the tiny random Llama (fast; no correctness claims about KV)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.engine.runner import ModelRunner, PrefillChunk, SamplingParams, Sequence, StepPlan
from kvmesh.engine.torch_runner import TorchRunner

PROMPT = list(range(3, 103))


def _seq(request_id: str = "r", prompt: list[int] | None = None, **sampling) -> Sequence:
    tokens = list(prompt or PROMPT)
    return Sequence(request_id, tokens, len(tokens), SamplingParams(**sampling))


def test_info_describes_the_model(tiny_runner: TorchRunner) -> None:
    runner: ModelRunner = tiny_runner
    info = runner.info
    assert info.model_name == "kvmesh/tiny-random-llama"
    assert (info.kv.num_layers, info.kv.num_kv_heads, info.kv.head_dim, info.kv.dtype) == (
        2,
        2,
        16,
        "float32",
    )
    assert info.kv.bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert info.vocab_size == 259
    assert info.eos_token_ids == (2,)
    assert info.max_model_len == 4096
    assert info.device == "cpu"


def test_prefill_advances_and_samples(tiny_runner: TorchRunner) -> None:
    seq = _seq()
    out = tiny_runner.execute_sync(StepPlan(prefills=[PrefillChunk(seq, 0, 60)]))
    assert seq.num_computed_tokens == 60
    assert out.sampled == {} and out.last_logits == {}
    out = tiny_runner.execute_sync(StepPlan(prefills=[PrefillChunk(seq, 60, 100)]))
    assert seq.num_computed_tokens == 100
    assert list(out.sampled) == ["r"]
    logits = out.last_logits["r"]
    assert logits.shape == (259,) and logits.dtype == np.float32
    assert out.sampled["r"] == int(np.argmax(logits))
    kv = tiny_runner.export_kv(seq, 0, 100)
    assert kv is not None and kv.shape == (2, 2, 2, 100, 16) and kv.dtype == np.float32
    tiny_runner.free(seq)
    assert seq.runner_state is None
    assert tiny_runner.export_kv(seq, 0, 10) is None


def test_chunked_and_cached_prefill_match_one_shot(tiny_runner: TorchRunner, generate) -> None:
    cold_tokens, cold_logits = generate(tiny_runner, PROMPT, 6)
    chunk_tokens, chunk_logits = generate(tiny_runner, PROMPT, 6, chunk=7)
    donor = _seq("donor")
    tiny_runner.execute_sync(StepPlan(prefills=[PrefillChunk(donor, 0, 100)]))
    kv = tiny_runner.export_kv(donor, 0, 80)
    tiny_runner.free(donor)
    warm_tokens, warm_logits = generate(tiny_runner, PROMPT, 6, cached_kv=kv, cached=80)
    assert chunk_tokens == cold_tokens == warm_tokens
    for a, b, c in zip(cold_logits, chunk_logits, warm_logits, strict=True):
        assert np.abs(a - b).max() <= 1e-4
        assert np.abs(a - c).max() <= 1e-4


def test_longer_cached_kv_is_trimmed_to_start(tiny_runner: TorchRunner, generate) -> None:
    donor = _seq("donor")
    tiny_runner.execute_sync(StepPlan(prefills=[PrefillChunk(donor, 0, 100)]))
    kv = tiny_runner.export_kv(donor, 0, 100)
    tiny_runner.free(donor)
    cold, _ = generate(tiny_runner, PROMPT, 3)
    seq = _seq()
    out = tiny_runner.execute_sync(StepPlan(prefills=[PrefillChunk(seq, 50, 100, cached_kv=kv)]))
    assert out.sampled["r"] == cold[0]
    whole = _seq("whole")
    out = tiny_runner.execute_sync(StepPlan(prefills=[PrefillChunk(whole, 100, 100, cached_kv=kv)]))
    assert whole.num_computed_tokens == 100 and out.sampled["whole"] == cold[0]
    np.testing.assert_array_equal(tiny_runner.export_kv(whole, 0, 99), kv[:, :, :, :99])


def test_decode_appends_one_token(tiny_runner: TorchRunner) -> None:
    seq = _seq()
    out = tiny_runner.execute_sync(StepPlan(prefills=[PrefillChunk(seq, 0, 100)]))
    seq.token_ids.append(out.sampled["r"])
    out = tiny_runner.execute_sync(StepPlan(decodes=[seq]))
    assert seq.num_computed_tokens == 101
    assert tiny_runner.export_kv(seq, 100, 101).shape == (2, 2, 2, 1, 16)
    tiny_runner.free(seq)


@pytest.mark.parametrize(
    ("start", "end", "kv_tokens", "match"),
    [
        (10, 20, None, "without cached_kv"),
        (10, 20, 5, "holds 5 tokens"),
        (0, 101, None, "beyond its 100 tokens"),
        (20, 10, 20, "empty chunk"),
    ],
)
def test_bad_first_chunks_are_refused(tiny_runner, start, end, kv_tokens, match) -> None:
    kv = None if kv_tokens is None else np.zeros((2, 2, 2, kv_tokens, 16), np.float32)
    seq = _seq()
    with pytest.raises(ValueError, match=match):
        tiny_runner.execute_sync(StepPlan(prefills=[PrefillChunk(seq, start, end, cached_kv=kv)]))
    assert seq.runner_state is None and seq.num_computed_tokens == 0


def test_wrong_kv_shape_is_refused(tiny_runner: TorchRunner) -> None:
    seq = _seq()
    with pytest.raises(ValueError, match="does not match"):
        tiny_runner.execute_sync(
            StepPlan(prefills=[PrefillChunk(seq, 10, 20, cached_kv=np.zeros((2, 2, 4, 10, 16), np.float32))])
        )


def test_bad_plan_changes_nothing(tiny_runner: TorchRunner) -> None:
    good = _seq("good")
    tiny_runner.execute_sync(StepPlan(prefills=[PrefillChunk(good, 0, 50)]))
    fresh = _seq("fresh")
    with pytest.raises(ValueError, match="starts at 40 but 50"):
        tiny_runner.execute_sync(
            StepPlan(prefills=[PrefillChunk(fresh, 0, 100), PrefillChunk(good, 40, 100)])
        )
    assert fresh.runner_state is None and good.num_computed_tokens == 50
    with pytest.raises(ValueError, match="decode before its prefill"):
        tiny_runner.execute_sync(StepPlan(decodes=[fresh]))
    with pytest.raises(ValueError, match="nothing to compute"):
        tiny_runner.execute_sync(StepPlan(decodes=[_prefilled(tiny_runner)]))
    with pytest.raises(ValueError, match="continuation"):
        kv = np.zeros((2, 2, 2, 50, 16), np.float32)
        tiny_runner.execute_sync(StepPlan(prefills=[PrefillChunk(good, 50, 100, cached_kv=kv)]))
    with pytest.raises(ValueError, match="outside the 50 computed"):
        tiny_runner.export_kv(good, 0, 51)
    tiny_runner.free(good)


def _prefilled(runner: TorchRunner) -> Sequence:
    seq = _seq("done")
    runner.execute_sync(StepPlan(prefills=[PrefillChunk(seq, 0, 100)]))
    return seq


def test_max_model_len_is_enforced(tiny_runner: TorchRunner) -> None:
    prompt = [5] * 10
    runner = TorchRunner(tiny_runner.model, model_name="t", eos_token_ids=(2,), max_model_len=8)
    try:
        with pytest.raises(ValueError, match="exceed max_model_len 8"):
            runner.execute_sync(StepPlan(prefills=[PrefillChunk(_seq(prompt=prompt), 0, 10)]))
        with pytest.raises(ValueError, match="exceeds the model's 4096"):
            TorchRunner(tiny_runner.model, model_name="t", eos_token_ids=(2,), max_model_len=5000)
    finally:
        runner.close()


async def test_execute_runs_off_the_event_loop(tiny_runner: TorchRunner) -> None:
    import threading

    seen: list[str] = []
    original = tiny_runner.execute_sync

    def spy(plan: StepPlan):
        seen.append(threading.current_thread().name)
        return original(plan)

    tiny_runner.execute_sync = spy  # type: ignore[method-assign]
    try:
        seq = _seq()
        out = await tiny_runner.execute(StepPlan(prefills=[PrefillChunk(seq, 0, 100)]))
    finally:
        del tiny_runner.execute_sync
    assert "r" in out.sampled
    assert seen and seen[0].startswith("kvmesh-torch")
    tiny_runner.free(seq)


def test_seeded_sampling_is_independent_of_batch(tiny_runner: TorchRunner, generate) -> None:
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 7}
    alone, _ = generate(tiny_runner, PROMPT, 6, sampling=SamplingParams(max_tokens=6, **params))
    a = _seq("a", **params)
    b = _seq("b", prompt=[9] * 20, temperature=1.0, seed=99)
    out = tiny_runner.execute_sync(StepPlan(prefills=[PrefillChunk(b, 0, 20), PrefillChunk(a, 0, 100)]))
    tokens = [out.sampled["a"]]
    while len(tokens) < 6:
        a.token_ids.append(tokens[-1])
        b.token_ids.append(out.sampled["b"])
        out = tiny_runner.execute_sync(StepPlan(decodes=[b, a]))
        tokens.append(out.sampled["a"])
    assert tokens == alone
    tiny_runner.free(a)
    tiny_runner.free(b)


@pytest.mark.parametrize("batch_decodes", [True, False])
def test_decodes_share_one_forward_when_batched(tiny_runner: TorchRunner, batch_decodes: bool) -> None:
    runner = TorchRunner(
        tiny_runner.model,
        model_name="t",
        eos_token_ids=(2,),
        batch_decodes=batch_decodes,
        keep_decode_logits=True,
    )
    calls: list[int] = []
    hook = runner.model.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        seqs = [_seq(f"s{n}", prompt=list(range(5, 5 + n))) for n in (7, 30, 64)]
        out = runner.execute_sync(StepPlan(prefills=[PrefillChunk(s, 0, len(s.token_ids)) for s in seqs]))
        for s in seqs:
            s.token_ids.append(out.sampled[s.request_id])
        calls.clear()
        out = runner.execute_sync(StepPlan(decodes=seqs))
        assert len(calls) == (1 if batch_decodes else 3)
        for s in seqs:
            assert s.num_computed_tokens == len(s.token_ids)
            solo = _seq("solo", prompt=s.token_ids)
            ref = runner.execute_sync(StepPlan(prefills=[PrefillChunk(solo, 0, len(solo.token_ids))]))
            assert out.sampled[s.request_id] == ref.sampled["solo"]
            assert np.abs(out.last_logits[s.request_id] - ref.last_logits["solo"]).max() <= 1e-4
            runner.free(s)
    finally:
        hook.remove()
        runner.close()
