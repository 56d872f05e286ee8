"""KV kept as tensors on the model's device: the device tier never leaves it, the store gets numpy.

A GPU runner hands the engine device tensors (``DeviceKVOps``); the same path runs here on CPU
tensors (``tensor_kv=True``), or on a GPU with ``KVMESH_TEST_DEVICE=cuda``. Real parts: the tiny
random Llama computes KV, two in-process engines share a store directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch

from kvmesh.core.torch_kv import from_store_array
from kvmesh.engine.app import EngineOptions, build_engine
from kvmesh.engine.server import EngineServer
from kvmesh.engine.torch_runner import DeviceKVOps, TorchRunner

pytestmark = pytest.mark.slow

DEVICE = os.environ.get("KVMESH_TEST_DEVICE", "cpu")
PROMPT = [(i * 11) % 240 + 3 for i in range(700)]  # two full store chunks and a partial one


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """``await engine()`` → a started engine on tensor KV sharing ``tmp_path``'s store directory."""
    running: list[EngineServer] = []

    async def make() -> EngineServer:
        runner = TorchRunner.load("tiny-random-llama", device=DEVICE, dtype="float32", tensor_kv=True)
        assert runner.tokenizer is not None
        opts = EngineOptions(model="tiny-random-llama", store=f"file://{tmp_path / 'shared'}")
        server = await build_engine(opts, runner=runner, tokenizer=runner.tokenizer)
        await server.start("127.0.0.1", 0)
        running.append(server)
        return server

    yield make
    for server in running:
        await server.stop()


async def complete(server: EngineServer, prompt: list[int]) -> tuple[str, int]:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http,
        http.post(f"{server.url}/v1/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        out = await r.json()
    return out["choices"][0]["text"], int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def device_tier_arrays(server: EngineServer) -> list[Any]:
    return [base for base, _offset in server.core.cache._kv.values()]


async def test_device_tier_and_store_serve_tensor_kv(engine: Callable[..., Any]) -> None:
    writer = await engine()
    assert isinstance(writer.core.runner.kv_ops, DeviceKVOps)
    cold, cached = await complete(writer, PROMPT)
    assert cached == 0
    arrays = device_tier_arrays(writer)
    assert arrays and all(isinstance(a, torch.Tensor) and a.device.type == DEVICE for a in arrays)
    hit, cached = await complete(writer, PROMPT)
    assert cached >= 688 and hit == cold  # every full block but the last token's
    await writer.core.wait_store_writes()

    reader = await engine()
    loaded, cached = await complete(reader, PROMPT)
    assert cached == 512 and loaded == cold  # the store's two full chunks
    assert all(isinstance(a, torch.Tensor) for a in device_tier_arrays(reader))
    stats = reader.core.stats
    assert stats.num_store_loads == 1 and stats.store_fetch_seconds > 0 and stats.store_to_runner_seconds > 0
    async with aiohttp.ClientSession() as http, http.get(f"{reader.url}/metrics") as r:
        text = await r.text()
    assert re.search(r"^kvmesh:store_loads_total\{[^}]*\} 1\.0$", text, re.M), text
    assert "kvmesh:store_to_device_seconds_total" in text


def test_device_ops_round_trip_the_store_form() -> None:
    ops = DeviceKVOps(torch.device(DEVICE), torch.bfloat16)
    kv = torch.randn(2, 2, 3, 40, 8, device=DEVICE).to(torch.bfloat16)
    host = ops.to_host(kv)
    assert host.dtype == np.uint16 and host.shape == (2, 2, 3, 40, 8)
    back = ops.from_host(host)
    assert torch.equal(back, kv)
    block = ops.copy(kv[:, :, :, 16:32])
    assert block.is_contiguous() and block.data_ptr() != kv.data_ptr()
    assert torch.equal(ops.concat([kv[:, :, :, :16], block, kv[:, :, :, 32:]]), kv)


def test_device_ops_join_read_only_chunks_without_copying_them_on_the_host() -> None:
    ops = DeviceKVOps(torch.device(DEVICE), torch.bfloat16)
    kv = torch.randn(2, 2, 3, 48, 8).to(torch.bfloat16)
    host = ops.to_host(kv)
    parts = []
    for start in range(0, 48, 16):
        data = host[:, :, :, start : start + 16].tobytes()  # what a tier returns
        part = np.frombuffer(data, dtype=np.uint16).reshape(2, 2, 3, 16, 8)
        assert not part.flags.writeable
        wrapped = from_store_array(part, torch.bfloat16)
        assert wrapped.data_ptr() == part.ctypes.data  # wrapped where it lies, not copied
        parts.append(part)
    joined = ops.join_host(parts)
    assert joined.device.type == DEVICE and joined.dtype == torch.bfloat16
    assert torch.equal(joined.cpu(), kv)
    with pytest.raises(ValueError, match="float16"):
        ops.join_host([np.zeros((2, 2, 3, 16, 8), np.float16)])


async def test_kv_the_runner_cannot_hand_over_is_not_cached_and_nothing_fails(
    engine: Callable[..., Any],
) -> None:
    """Out of device memory for a copy: blocks go uncached and the prompt unwritten, the requests
    succeed and the engine keeps serving."""
    server = await engine()
    runner = server.core.runner

    def no_memory(*args: Any) -> Any:
        raise RuntimeError("CUDA out of memory (simulated)")

    runner.export_kv = no_memory
    text, cached = await complete(server, PROMPT)
    assert cached == 0 and text
    await server.core.wait_store_writes()
    stats = server.core.stats
    assert stats.num_kv_export_failures >= 1 and stats.num_store_write_failures == 1
    assert server.core.cache.num_cached_blocks == 0
    del runner.export_kv  # the class's method again
    again, cached = await complete(server, PROMPT)
    assert again == text and cached == 0


async def test_a_load_that_cannot_reach_the_device_is_recomputed(engine: Callable[..., Any]) -> None:
    writer = await engine()
    cold, _ = await complete(writer, PROMPT)
    await writer.core.wait_store_writes()
    reader = await engine()

    def no_memory(parts: Any) -> Any:
        raise RuntimeError("CUDA out of memory (simulated)")

    reader.core.runner.kv_ops.join_host = no_memory
    text, cached = await complete(reader, PROMPT)
    assert text == cold and cached == 0
    assert reader.core.stats.num_store_read_failures == 1


@pytest.mark.skipif(
    DEVICE != "cuda", reason="page-locked staging needs a CUDA device (KVMESH_TEST_DEVICE=cuda)"
)
def test_staged_copies_equal_direct_ones_across_buffer_reuse_and_growth() -> None:
    staged = DeviceKVOps(torch.device(DEVICE), torch.bfloat16)
    direct = DeviceKVOps(torch.device(DEVICE), torch.bfloat16, staged=False)
    assert staged.staged and not direct.staged
    for chunk in (16, 32, 16):  # the buffers grow for 32-token chunks, then are reused as they are
        kv = torch.randn(2, 2, 3, chunk * 5, 8).to(torch.bfloat16)
        host = staged.to_host(kv)
        # as a tier hands them out: read-only views of the bytes read (one of them not contiguous)
        parts = [
            np.frombuffer(host[:, :, :, s : s + chunk].tobytes(), np.uint16).reshape(2, 2, 3, chunk, 8)
            for s in range(0, chunk * 5, chunk)
        ]
        parts[2] = np.frombuffer(host.tobytes(), np.uint16).reshape(host.shape)[
            :, :, :, 2 * chunk : 3 * chunk
        ]
        assert not parts[2].flags.writeable and not parts[2].flags.c_contiguous
        joined = staged.join_host(parts)
        assert torch.equal(joined, direct.join_host(parts))
        assert torch.equal(joined.cpu(), kv)


def test_staged_copies_are_refused_off_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        DeviceKVOps(torch.device("cpu"), torch.bfloat16, staged=True)
