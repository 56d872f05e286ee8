"""Emulated engines on a real KV store: placeholder chunks written, found, loaded and priced.

Real parts throughout: the store's RAM tier and a shared directory, engines serving HTTP on loopback
ports. What is modelled is checked through the runner's step accounting (``busy_seconds``, the sum
of the step times it slept for), which is exact, rather than through wall-clock time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvmesh.core.types import Medium
from kvmesh.engine.app import EngineOptions, build_engine
from kvmesh.engine.cost_model import PRESETS, CostModel
from kvmesh.engine.emulated_runner import EmulatedRunner
from kvmesh.engine.server import EngineServer
from kvmesh.store.cache_engine import KVCacheEngine
from kvmesh.store.codec import ChunkCodec

CHUNK = 256
PROMPT = [(i * 7) % 200 + 3 for i in range(4 * CHUNK)]
SUFFIX = [(i * 13) % 200 + 3 for i in range(100)]
OTHER = [(i * 11) % 200 + 3 for i in range(4 * CHUNK)]
QWEN = "qwen3-32b-h100-tp2"


async def complete(server: EngineServer, prompt: list[int]) -> tuple[int, float]:
    """One token of ``prompt``: (usage's cached tokens, seconds the request took)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    began = time.monotonic()
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http,
        http.post(f"{server.url}/v1/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        reply = await r.json()
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"], time.monotonic() - began


def runner(server: EngineServer) -> EmulatedRunner:
    assert isinstance(server.core.runner, EmulatedRunner)
    return server.core.runner


def store_engine(server: EngineServer) -> KVCacheEngine:
    engine = server.core.store._engine  # type: ignore[attr-defined]
    assert isinstance(engine, KVCacheEngine)
    return engine


def chunk_files(shared: Path) -> list[Path]:
    return sorted(shared.rglob("*.kvc"))


async def two_engines(make_engine: Callable[..., Any], shared: Path) -> tuple[Any, Any]:
    """Two emulated engines sharing the store directory ``shared``."""
    return (
        await make_engine(QWEN, store=f"file://{shared}"),
        await make_engine(QWEN, store=f"file://{shared}"),
    )


async def test_a_second_emulated_engine_loads_the_prompt_from_the_shared_tier_at_the_modelled_cost(
    make_engine: Callable[..., Any], tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    a, b = await two_engines(make_engine, shared)
    cost = CostModel(PRESETS[QWEN])

    cached, _ = await complete(a, PROMPT)
    assert cached == 0
    await a.core.wait_store_writes()
    files = chunk_files(shared)
    assert len(files) == 4
    for path in files:
        header = ChunkCodec().read_header(path.read_bytes())
        assert (header.dtype, tuple(header.shape)) == ("float16", (1, 2, 1, CHUNK, 1)), "a placeholder"
        assert path.stat().st_size < 2048, "4 bytes per token, not Qwen3-32B's 256 KiB"

    prompt = PROMPT + SUFFIX
    cached, seconds = await complete(b, prompt)
    assert cached == 4 * CHUNK
    assert b.core.stats.cached_tokens_by_tier == {"SHARED": 4 * CHUNK}
    # The first step pays the modelled load of the whole prefix (at Qwen3-32B's bytes per token over
    # the SHARED link: 28 ms), then prefills the rest; A prefilled everything.
    load = cost.kv_load_time(4 * CHUNK, "SHARED")
    assert load == pytest.approx(1.5e-3 + 4 * CHUNK * 262_144 / 10e9)
    expected = load + cost.step_time([(4 * CHUNK, len(prompt))], [])
    assert runner(b).num_steps == 1
    assert runner(b).busy_seconds == pytest.approx(expected, rel=1e-9)
    assert runner(a).busy_seconds == pytest.approx(cost.step_time([(0, len(PROMPT))], []), rel=1e-9)
    assert runner(b).busy_seconds < runner(a).busy_seconds
    assert seconds >= 0.9 * expected, "the engine slept for the modelled step"


async def test_a_dead_shared_tier_gives_misses(make_engine: Callable[..., Any], tmp_path: Path) -> None:
    blocked = tmp_path / "shared"
    blocked.write_text("a file where the shared directory should be: every read and write fails")
    a = await make_engine(QWEN, store=f"file://{blocked}")
    b = await make_engine(QWEN, store=f"file://{blocked}")
    await complete(a, PROMPT)
    await a.core.wait_store_writes()
    assert store_engine(a).tiered.tiers[1].counters.dropped_writes == 4
    cached, _ = await complete(b, PROMPT + SUFFIX)
    assert cached == 0
    cost = CostModel(PRESETS[QWEN])
    assert runner(b).busy_seconds == pytest.approx(cost.step_time([(0, len(PROMPT + SUFFIX))], []))


async def test_a_corrupt_chunk_ends_the_loaded_prefix(
    make_engine: Callable[..., Any], tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    a, b = await two_engines(make_engine, shared)
    await complete(a, PROMPT)
    await a.core.wait_store_writes()
    keys = store_engine(b).chunk_keys(PROMPT, b.core.cache.hasher.namespace)
    third = shared / f"{keys[2].name()}.kvc"
    data = bytearray(third.read_bytes())
    data[len(data) // 2] ^= 0xFF
    third.write_bytes(bytes(data))

    prompt = PROMPT + SUFFIX
    cached, _ = await complete(b, prompt)
    assert cached == 2 * CHUNK, "chunks 0 and 1; the corrupt chunk 2 is a miss and ends the prefix"
    fs = store_engine(b).tiered.tiers[1]
    assert fs.name == "fs" and fs.counters.corrupt == 1
    # Deleted from the tier, then written again by B, which computed it.
    await b.core.wait_store_writes()
    assert ChunkCodec().decode(third.read_bytes(), keys[2]).num_tokens == CHUNK
    cost = CostModel(PRESETS[QWEN])
    expected = cost.kv_load_time(2 * CHUNK, "SHARED") + cost.step_time([(2 * CHUNK, len(prompt))], [])
    assert runner(b).busy_seconds == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_medium_a_store_tier_reports_has_a_link_in_every_preset(preset: str) -> None:
    cost = CostModel(PRESETS[preset])
    for tier in ("cpu", "disk", "redis", "fs"):
        medium = Medium.parse(tier)
        assert medium is not Medium.GPU
        assert cost.kv_load_time(CHUNK, medium.value) > cost.kv_load_time(CHUNK, "GPU")


@pytest.mark.slow
async def test_real_and_emulated_engines_on_one_store_never_load_each_others_chunks(
    make_engine: Callable[..., Any], tmp_path: Path
) -> None:
    from kvmesh.engine.torch_runner import TorchRunner

    store = f"file://{tmp_path / 'shared'}"
    torch_runner = TorchRunner.load("tiny-random-llama")
    assert torch_runner.tokenizer is not None
    real = await build_engine(
        EngineOptions(model="tiny-random-llama", store=store),
        runner=torch_runner,
        tokenizer=torch_runner.tokenizer,
    )
    await real.start("127.0.0.1", 0)
    try:
        name = torch_runner.info.model_name
        emulated = await make_engine("tiny-h100", served_model_name=name, store=store)
        emulated_too = await make_engine("tiny-h100", served_model_name=name, store=store)
        # The same model name and revision: only the KV format tells their chunks apart.
        namespace = real.core.cache.hasher.namespace
        assert emulated.core.cache.hasher.namespace == namespace
        real_keys = store_engine(real).chunk_keys(PROMPT, namespace)
        emulated_keys = store_engine(emulated).chunk_keys(PROMPT, namespace)
        assert not set(real_keys) & set(emulated_keys)

        assert (await complete(real, PROMPT))[0] == 0
        await real.core.wait_store_writes()
        assert (await complete(emulated, PROMPT + SUFFIX))[0] == 0
        await emulated.core.wait_store_writes()
        assert (await complete(emulated, OTHER))[0] == 0
        await emulated.core.wait_store_writes()
        assert (await complete(real, OTHER + SUFFIX))[0] == 0
        await real.core.wait_store_writes()
        assert real.core.stats.cached_tokens_by_tier == {}
        assert emulated.core.stats.cached_tokens_by_tier == {}
        assert len(chunk_files(tmp_path / "shared")) == 16, "each kind wrote both prompts under its own keys"
        # Each kind does find its own kind's chunks.
        assert (await complete(emulated_too, PROMPT + SUFFIX))[0] == 4 * CHUNK
        assert (await complete(emulated_too, OTHER + SUFFIX))[0] == 4 * CHUNK
    finally:
        await real.stop()
