"""SHARED events: an engine announces the prompts its background writes put in a shared store tier.

Real parts throughout: the tiny random Llama computes KV, the store has a RAM tier and a shared
directory tier, and events are read from the engine's ZMQ socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvmesh.core.event_transport import ZmqEventSubscriber
from kvmesh.core.events import BlockStored
from kvmesh.engine.app import EngineOptions, build_engine
from kvmesh.engine.prefix_cache import engine_block_hash
from kvmesh.engine.server import EngineServer

pytestmark = pytest.mark.slow

CHUNK = 256
PROMPT = [(i * 7) % 200 + 3 for i in range(600)]  # two full chunks and a partial one
MARKER = [5] * 40  # shorter than a chunk: never written to the store


class EventStream:
    """Every event an engine publishes, read through its PUB socket (and replay)."""

    def __init__(self, server: EngineServer) -> None:
        self.events: list[Any] = []
        info = server.info_dict()
        self._sub = ZmqEventSubscriber(lambda pod, seq, batch: self.events.extend(batch.events))
        self._sub.add_publisher("e", info["events_endpoint"], info["replay_endpoint"])
        self._task = asyncio.create_task(self._sub.run())

    async def aclose(self) -> None:
        await self._sub.aclose()
        await self._task

    def stored(self, medium: str) -> list[BlockStored]:
        return [e for e in self.events if isinstance(e, BlockStored) and e.medium == medium]


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """``await start(store, **options)`` → (server, its event stream); all stop at teardown."""
    running: list[tuple[EngineServer, EventStream]] = []

    async def make(store: str, **options: Any) -> tuple[EngineServer, EventStream]:
        opts = EngineOptions(
            model="tiny-random-llama",
            store=store,
            events="tcp://127.0.0.1:0",
            events_replay="tcp://127.0.0.1:0",
            **options,
        )
        server = await build_engine(opts)
        await server.start("127.0.0.1", 0)
        stream = EventStream(server)
        running.append((server, stream))
        return server, stream

    yield make
    for server, stream in running:
        await stream.aclose()
        await server.stop()


async def complete(server: EngineServer, prompt: list[int], tenant: str = "") -> None:
    """One token: the request is done in the step that queues its store write, so the engine is
    idle when the write lands and only its wake-up publishes the SHARED event."""
    headers = {"x-tenant-id": tenant} if tenant else {}
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    url = f"{server.url}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(url, json=body, headers=headers) as r,
    ):
        assert r.status == 200, await r.text()


async def settle(server: EngineServer, stream: EventStream, eventually: Callable[..., Any]) -> None:
    """Return once every event of the store writes started so far is in ``stream``.

    The writes' events are published before the next step's (one publisher, one loop), so once the
    marker request's GPU event has arrived, any SHARED event they produced has too.
    """
    await server.core.wait_store_writes()
    await complete(server, MARKER)
    marker = MARKER[:32]
    assert await eventually(lambda: any(e.token_ids[:32] == marker for e in stream.stored("GPU")), 60)


def gpu_hashes(stream: EventStream) -> list[int]:
    return [h for e in stream.stored("GPU") for h in e.block_hashes]


async def test_prompt_in_the_shared_tier_is_announced_from_the_root(
    start: Callable[..., Any], tmp_path: Path, eventually: Callable[..., Any]
) -> None:
    server, stream = await start(f"file://{tmp_path / 'shared'}")
    await complete(server, PROMPT)
    assert await eventually(lambda: len(stream.stored("SHARED")) == 1, 60)
    (shared,) = stream.stored("SHARED")
    keys = server.core.cache.block_keys(PROMPT)
    expected = [engine_block_hash(k) for k in keys[: 2 * CHUNK // 16]]
    assert shared.block_hashes == expected
    assert shared.block_hashes == gpu_hashes(stream)[: len(expected)], "the hashes the GPU event announced"
    assert shared.parent_block_hash is None
    assert shared.token_ids == PROMPT[: 2 * CHUNK]
    assert shared.block_size == 16
    assert shared.extra_keys == [None] * 32  # vLLM's form: one entry per block
    assert stream.events.index(shared) > stream.events.index(stream.stored("GPU")[0])

    # Same prompt again: nothing new to write, nothing new to announce. A longer one reaching a third
    # chunk is announced whole, again from the root.
    await complete(server, PROMPT)
    longer = PROMPT + [(i * 11) % 200 + 3 for i in range(200)]
    await complete(server, longer)
    await settle(server, stream, eventually)
    assert [len(e.block_hashes) for e in stream.stored("SHARED")] == [32, 48]
    extended = stream.stored("SHARED")[1]
    assert extended.token_ids == longer[: 3 * CHUNK]
    assert extended.parent_block_hash is None
    assert extended.block_hashes[:32] == expected


async def test_tenant_goes_into_extra_keys_as_in_the_device_event(
    start: Callable[..., Any], tmp_path: Path, eventually: Callable[..., Any]
) -> None:
    server, stream = await start(f"file://{tmp_path / 'shared'}")
    await complete(server, PROMPT, tenant="acme")
    assert await eventually(lambda: len(stream.stored("SHARED")) == 1, 60)
    (shared,) = stream.stored("SHARED")
    (device,) = [e for e in stream.stored("GPU") if e.parent_block_hash is None]
    assert shared.extra_keys == [["acme"]] + [None] * 31
    assert device.extra_keys is not None and shared.extra_keys == device.extra_keys[:32]
    keys = server.core.cache.block_keys(PROMPT, "acme")
    assert shared.block_hashes == [engine_block_hash(k) for k in keys[:32]]
    assert shared.block_hashes == device.block_hashes[:32]


async def test_a_failed_shared_write_announces_nothing(
    start: Callable[..., Any], tmp_path: Path, eventually: Callable[..., Any]
) -> None:
    blocked = tmp_path / "shared"
    blocked.write_text("a file where the shared directory should be: every write fails")
    server, stream = await start(f"file://{blocked}")
    await complete(server, PROMPT)
    await settle(server, stream, eventually)
    tiers = {t.name: t for t in server.core.store._engine.tiered.tiers}  # type: ignore[attr-defined]
    assert tiers["fs"].counters.dropped_writes == 2, "the write reached the tier and failed"
    assert tiers["cpu"].counters.bytes_written > 0
    assert stream.stored("SHARED") == []


@pytest.mark.parametrize("case", ["ram_tier_only", "switched_off"])
async def test_no_shared_tier_or_switched_off_announces_nothing(
    case: str, start: Callable[..., Any], tmp_path: Path, eventually: Callable[..., Any]
) -> None:
    if case == "ram_tier_only":
        server, stream = await start("memory")
    else:
        server, stream = await start(f"file://{tmp_path / 'shared'}", announce_shared_writes=False)
    await complete(server, PROMPT)
    await settle(server, stream, eventually)
    assert server.core.stats.num_store_writes == 1
    assert stream.stored("GPU") and stream.stored("SHARED") == []
    # The RAM tier is announced on its own (CPU events, tests/engine/test_engine_local_tier_events.py).
    assert {e.medium for e in stream.events if isinstance(e, BlockStored)} == {"GPU", "CPU"}
    if case == "switched_off":
        assert any((tmp_path / "shared").rglob("*")), "the shared tier was written, just not announced"


@pytest.mark.parametrize("announce", [True, False])
async def test_an_emulated_engine_announces_its_shared_writes_as_a_real_one(
    announce: bool, start: Callable[..., Any], tmp_path: Path, eventually: Callable[..., Any]
) -> None:
    shared_dir = tmp_path / "shared"
    server, stream = await start(
        f"file://{shared_dir}", emulate="qwen3-32b-h100-tp2", announce_shared_writes=announce
    )
    await complete(server, PROMPT)
    await settle(server, stream, eventually)
    assert server.core.stats.num_store_writes == 1
    assert len(list(shared_dir.rglob("*.kvc"))) == 2, "placeholder chunks in the shared tier"
    if not announce:
        assert stream.stored("GPU") and stream.stored("SHARED") == []
        return
    (shared,) = stream.stored("SHARED")
    keys = server.core.cache.block_keys(PROMPT)
    assert shared.block_hashes == [engine_block_hash(k) for k in keys[: 2 * CHUNK // 16]]
    assert shared.block_hashes == gpu_hashes(stream)[:32]
    assert shared.parent_block_hash is None
    assert shared.token_ids == PROMPT[: 2 * CHUNK]
    assert stream.events.index(shared) > stream.events.index(stream.stored("GPU")[0])
