"""CPU and DISK events: an engine announces what its own RAM and disk store tiers hold, and the router's
index follows them through device evictions and tier evictions.

An emulated engine (placeholder KV, real store tiers) publishes on a real ZMQ socket; the router's
EventApplier and InMemoryIndex apply what a subscriber receives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from kvmesh.core.event_transport import ZmqEventSubscriber
from kvmesh.core.events import BlockRemoved, BlockStored, KVEvent
from kvmesh.core.hashing import HashAlgo
from kvmesh.core.types import BlockKey, ExternalBlockHash, Medium, PodId
from kvmesh.engine.prefix_cache import engine_block_hash
from kvmesh.engine.server import EngineServer
from kvmesh.router.index import InMemoryIndex, MediumSet, medium_set
from kvmesh.router.ingest import EventApplier
from kvmesh.store.codec import ChunkCodec
from kvmesh.store.config import GB
from kvmesh.store.keys import StoreKey

POD = PodId("engine")
CHUNK = 256


def prompt(seed: int) -> list[int]:
    """600 tokens: two full chunks (32 blocks) and a partial one; each seed its own chain."""
    return [seed] + [(i * 7 + seed) % 200 + 3 for i in range(599)]


A, B, C, D = (prompt(s) for s in (11, 12, 13, 14))
GPU = medium_set(Medium.GPU)
PLACEHOLDER_CHUNK_BYTES = len(
    ChunkCodec().encode(StoreKey("0" * 16, BlockKey(bytes(16))), np.zeros((1, 2, 1, CHUNK, 1), np.float16))
)


class Router:
    """The router's side: a subscriber on the engine's socket feeding an EventApplier."""

    def __init__(self, server: EngineServer) -> None:
        info = server.info_dict()
        self.index = InMemoryIndex()
        self.applier = EventApplier(
            self.index, model=info["model"], revision=info["revision"], block_size=16, algo=HashAlgo.SHA256
        )
        self.events: list[KVEvent] = []
        self.num_markers = 0

        def on_batch(pod: PodId, seq: int, batch: Any) -> None:
            self.events.extend(batch.events)
            self.applier.apply_batch(POD, batch)

        self._sub = ZmqEventSubscriber(on_batch)
        self._sub.add_publisher(POD, info["events_endpoint"], info["replay_endpoint"])
        self._task = asyncio.create_task(self._sub.run())

    async def aclose(self) -> None:
        await self._sub.aclose()
        await self._task

    def media(self, keys: list[BlockKey]) -> list[MediumSet]:
        """The engine's tiers per block, as the index has them, up to the first block it lacks."""
        return [holders[POD] for holders in self.index.lookup(keys) if POD in holders]

    def of(self, medium: str) -> list[KVEvent]:
        return [e for e in self.events if getattr(e, "medium", None) == medium]


def store_config(tmp_path: Path, *, cpu_chunks: float = 0, disk_chunks: float = 0) -> str:
    """A store config file: RAM and/or local disk tiers holding that many placeholder chunks."""
    lines = [f"chunk_size: {CHUNK}", f"local_cpu: {'true' if cpu_chunks else 'false'}"]
    if cpu_chunks:
        lines.append(f"max_local_cpu_size: {cpu_chunks * PLACEHOLDER_CHUNK_BYTES / GB!r}")
    if disk_chunks:
        lines.append(f"local_disk: {tmp_path / 'disk'}")
        lines.append(f"max_local_disk_size: {disk_chunks * PLACEHOLDER_CHUNK_BYTES / GB!r}")
    path = tmp_path / "store.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
async def start(make_engine: Callable[..., Any]) -> AsyncIterator[Callable[..., Any]]:
    """``await start(store, **options)`` → (an emulated engine whose device holds 1024 tokens, the
    router following it)."""
    routers: list[Router] = []

    async def make(store: str, **options: Any) -> tuple[EngineServer, Router]:
        server = await make_engine(
            store=store,
            events="tcp://127.0.0.1:0",
            events_replay="tcp://127.0.0.1:0",
            kv_capacity_tokens=1024,
            **options,
        )
        router = Router(server)
        routers.append(router)
        return server, router

    yield make
    for router in routers:
        await router.aclose()


async def complete(server: EngineServer, tokens: list[int]) -> None:
    body = {"prompt": tokens, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
        http.post(f"{server.url}/v1/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()


async def run(
    server: EngineServer, router: Router, tokens: list[int], eventually: Callable[..., Any]
) -> None:
    """Complete ``tokens`` and return once the router has every event of its store write.

    Store events are published before the next step's device events, so once the marker request's
    GPU event has arrived, the write's events have too.
    """
    await complete(server, tokens)
    await server.core.wait_store_writes()
    router.num_markers += 1
    marker = [router.num_markers] + [4] * 39  # shorter than a chunk: never written to the store
    await complete(server, marker)
    assert await eventually(
        lambda: any(isinstance(e, BlockStored) and e.token_ids[:32] == marker[:32] for e in router.of("GPU")),
        30,
    )


def hashes(keys: list[BlockKey]) -> list[ExternalBlockHash]:
    return [engine_block_hash(k) for k in keys]


@pytest.mark.parametrize("medium", ["CPU", "DISK"])
async def test_the_router_follows_a_prompt_into_the_local_tier_and_out(
    medium: str, start: Callable[..., Any], tmp_path: Path, eventually: Callable[..., Any]
) -> None:
    tier = medium_set(Medium(medium))
    chunks = {"cpu_chunks": 6.5} if medium == "CPU" else {"disk_chunks": 6.5}  # A, B and C; D evicts A
    server, router = await start(store_config(tmp_path, **chunks))
    keys = server.core.cache.block_keys(A)
    assert len(keys) == 37

    await run(server, router, A, eventually)
    (stored,) = router.of(medium)
    assert stored == BlockStored(
        block_hashes=hashes(keys[:32]), parent_block_hash=None, token_ids=[], block_size=16, medium=medium
    ), "the device announced these blocks first: no tokens needed"
    assert router.media(keys) == [GPU | tier] * 32 + [GPU] * 5

    await run(server, router, B, eventually)
    await run(server, router, C, eventually)
    assert server.core.cache.match(keys) == 0, "the device evicted A"
    assert router.media(keys) == [tier] * 32, "the engine still holds A's chunks in its own tier"
    assert [e for e in router.of(medium) if isinstance(e, BlockRemoved)] == []

    await run(server, router, D, eventually)
    removed = [e for e in router.of(medium) if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(block_hashes=hashes(keys[:32]), medium=medium)], "D's chunks evicted A's"
    assert router.index.lookup(keys) == []
    b_keys = server.core.cache.block_keys(B)
    assert server.core.cache.match(b_keys) == 0
    assert router.media(b_keys) == [tier] * 32, "B stays: only its own tier holds it now"
    announcer = server.core.store_sync.local
    assert announcer is not None and announcer.num_announced == 6 and announcer.num_unannounced == 0


async def test_ram_and_disk_tiers_both_announce_and_the_disk_outlives_the_ram(
    start: Callable[..., Any], tmp_path: Path, eventually: Callable[..., Any]
) -> None:
    server, router = await start(store_config(tmp_path, cpu_chunks=2.5, disk_chunks=20))
    keys = server.core.cache.block_keys(A)
    cpu, disk = medium_set(Medium.CPU), medium_set(Medium.DISK)
    await run(server, router, A, eventually)
    assert router.media(keys) == [GPU | cpu | disk] * 32 + [GPU] * 5
    await run(server, router, B, eventually)  # the RAM tier holds two chunks: B's replace A's
    b_keys = server.core.cache.block_keys(B)
    assert router.of("CPU") == [
        BlockStored(
            block_hashes=hashes(keys[:32]), parent_block_hash=None, token_ids=[], block_size=16, medium="CPU"
        ),
        BlockRemoved(block_hashes=hashes(keys[:32]), medium="CPU"),
        BlockStored(
            block_hashes=hashes(b_keys[:32]),
            parent_block_hash=None,
            token_ids=[],
            block_size=16,
            medium="CPU",
        ),
    ]
    await run(server, router, C, eventually)
    assert server.core.cache.match(keys) == 0
    assert router.media(keys) == [disk] * 32


async def test_switched_off_nothing_is_announced(
    start: Callable[..., Any], tmp_path: Path, eventually: Callable[..., Any]
) -> None:
    server, router = await start(
        store_config(tmp_path, cpu_chunks=2.5, disk_chunks=20), announce_local_tiers=False
    )
    for tokens in (A, B):
        await run(server, router, tokens, eventually)
    assert server.core.store_sync.local is None
    assert server.core.stats.num_store_writes == 2
    assert {getattr(e, "medium", None) for e in router.events} == {"GPU"}
    keys = server.core.cache.block_keys(A)
    assert router.media(keys) == [GPU] * server.core.cache.match(keys), "what the device holds, no more"
    tiers = {t.name: t for t in server.core.store._engine.tiered.tiers}
    assert tiers["cpu"].backend.num_evictions == 2, "the RAM tier evicted A's chunks, unannounced"
