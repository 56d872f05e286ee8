"""A bfloat16 model's KV leaves and re-enters the runner at 2 bytes per element, bit for bit.

Runs on the CPU; ``KVMESH_TEST_DEVICE=cuda`` runs the same checks on a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvmesh.engine.runner import PrefillChunk, SamplingParams, Sequence, StepPlan
from kvmesh.engine.torch_runner import TorchRunner

PROMPT = list(range(3, 83))


@pytest.fixture(scope="module")
def bf16_runner() -> Iterator[TorchRunner]:
    device = os.environ.get("KVMESH_TEST_DEVICE", "cpu")
    runner = TorchRunner.load(
        "tiny-random-llama", device=device, dtype="bfloat16", keep_decode_logits=True, tensor_kv=False
    )
    yield runner
    runner.close()


def _seq(request_id: str) -> Sequence:
    return Sequence(request_id, list(PROMPT), len(PROMPT), SamplingParams(max_tokens=1))


def test_layout_is_bfloat16_at_two_bytes(bf16_runner: TorchRunner) -> None:
    kv = bf16_runner.info.kv
    assert kv.dtype == "bfloat16"
    assert kv.bytes_per_token == 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * 2


def test_exported_kv_is_the_caches_bit_patterns(bf16_runner: TorchRunner) -> None:
    seq = _seq("donor")
    bf16_runner.execute_sync(StepPlan(prefills=[PrefillChunk(seq, 0, len(PROMPT))]))
    kv = bf16_runner.export_kv(seq, 0, 64)
    assert kv is not None and kv.dtype == np.uint16 and kv.shape == (2, 2, 2, 64, 16)
    state = seq.runner_state
    keys = state.cache.layers[1].keys[0, :, :64]  # type: ignore[union-attr]
    assert keys.dtype == torch.bfloat16
    np.testing.assert_array_equal(kv[1, 0], keys.cpu().view(torch.int16).numpy().view(np.uint16))
    bf16_runner.free(seq)


def test_reloaded_kv_continues_exactly_as_the_cache_did(bf16_runner: TorchRunner) -> None:
    """Second chunk after the device cache vs after the exported-and-reloaded KV: same logits."""
    ref = _seq("ref")
    bf16_runner.execute_sync(StepPlan(prefills=[PrefillChunk(ref, 0, 64)]))
    kv = bf16_runner.export_kv(ref, 0, 64)
    expected = bf16_runner.execute_sync(StepPlan(prefills=[PrefillChunk(ref, 64, len(PROMPT))]))
    bf16_runner.free(ref)
    warm = _seq("warm")
    got = bf16_runner.execute_sync(StepPlan(prefills=[PrefillChunk(warm, 64, len(PROMPT), cached_kv=kv)]))
    np.testing.assert_array_equal(got.last_logits["warm"], expected.last_logits["ref"])
    assert got.sampled["warm"] == expected.sampled["ref"]
    bf16_runner.free(warm)


def test_kv_of_another_dtype_is_refused_before_running(bf16_runner: TorchRunner) -> None:
    seq = _seq("wrong")
    widened = np.zeros((2, 2, 2, 64, 16), np.float32)
    with pytest.raises(ValueError, match="dtype"):
        bf16_runner.execute_sync(StepPlan(prefills=[PrefillChunk(seq, 64, len(PROMPT), cached_kv=widened)]))
    assert seq.runner_state is None and seq.num_computed_tokens == 0
