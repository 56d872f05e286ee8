"""Fixtures for the model runner tests: one SmolLM2 runner and one tiny random runner per session."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvmesh.engine.runner import PrefillChunk, SamplingParams, Sequence, StepPlan
from kvmesh.engine.torch_runner import TorchRunner

GenerateFn = Callable[..., tuple[list[int], list]]


@pytest.fixture(scope="session")
def smollm2_runner() -> Iterator[TorchRunner]:
    """The real SmolLM2-135M-Instruct in float32 on CPU (converted from its GGUF on first use)."""
    runner = TorchRunner.load("smollm2", device="cpu", dtype="float32", keep_decode_logits=True)
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def tiny_runner() -> Iterator[TorchRunner]:
    runner = TorchRunner.load("tiny-random-llama", keep_decode_logits=True)
    yield runner
    runner.close()


def _generate(
    runner: TorchRunner,
    prompt: list[int],
    num_tokens: int,
    *,
    request_id: str = "req",
    cached_kv=None,
    cached: int = 0,
    chunk: int | None = None,
    sampling: SamplingParams | None = None,
) -> tuple[list[int], list]:
    """Prefill ``prompt`` (after ``cached`` tokens from ``cached_kv``, in chunks of ``chunk``), then
    decode until ``num_tokens`` tokens exist. Returns (tokens, logits rows), and frees the sequence."""
    seq = Sequence(request_id, list(prompt), len(prompt), sampling or SamplingParams(max_tokens=num_tokens))
    start = cached
    step = chunk or len(prompt)
    out = None
    while True:
        end = min(start + step, len(prompt))
        kv = cached_kv if start == cached else None
        out = runner.execute_sync(StepPlan(prefills=[PrefillChunk(seq, start, end, cached_kv=kv)]))
        start = end
        if end >= len(prompt):
            break
    tokens = [out.sampled[request_id]]
    logits = [out.last_logits[request_id]]
    while len(tokens) < num_tokens:
        seq.token_ids.append(tokens[-1])
        out = runner.execute_sync(StepPlan(decodes=[seq]))
        tokens.append(out.sampled[request_id])
        logits.append(out.last_logits[request_id])
    runner.free(seq)
    return tokens, logits


@pytest.fixture(scope="session")
def generate() -> GenerateFn:
    return _generate
