"""Pins at the router: the request field's validation and forwarding, and pinned blocks kept in the
index under capacity pressure until their deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from kvmesh.core.pins import PIN_TTL_HEADER
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.engine.app import EngineOptions, build_engine
from kvmesh.errors import RequestError
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.gateway import Gateway
from kvmesh.router.index import SHARED_TIER_HOLDER, InMemoryIndex, medium_set
from kvmesh.router.pins import PinnedBlocks
from kvmesh.router.request_parser import RequestParser
from kvmesh.router.types import PrefixMatch, RoutingRequest


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def keys(first: int, n: int) -> list[BlockKey]:
    return [BlockKey(i.to_bytes(16, "big")) for i in range(first, first + n)]


POD = PodId("http://a:1")
GPU = medium_set(Medium.GPU)


def test_the_index_keeps_pinned_keys_under_capacity_pressure_until_their_deadline() -> None:
    clock = Clock()
    pinned = PinnedBlocks(clock)
    index = InMemoryIndex(10, keep=pinned.holds)
    held = keys(0, 4)
    index.add(held, POD, GPU)
    pinned.pin(held, 30.0)
    index.add(keys(100, 4), POD, GPU)

    index.add(keys(1000, 30), POD, GPU)  # three times the capacity
    assert len(index.lookup(held)) == 4, "a pinned key was evicted"
    assert index.lookup(keys(100, 1)) == [], "an unpinned key outlived the pressure"
    assert index.stats().num_keys == 10

    clock.now += 31.0
    index.add(keys(2000, 10), POD, GPU)
    assert index.lookup(held) == [], "the pin outlived its deadline"
    assert len(pinned) == 0


def test_an_index_of_only_pinned_keys_stays_over_capacity_rather_than_drop_one() -> None:
    pinned = PinnedBlocks(Clock())
    index = InMemoryIndex(4, keep=pinned.holds)
    pinned.pin(keys(0, 6), 60.0)
    index.add(keys(0, 6), POD, GPU)
    assert index.stats().num_keys == 6 and len(index.lookup(keys(0, 6))) == 6


def test_repinning_keeps_the_later_deadline() -> None:
    clock = Clock()
    pinned = PinnedBlocks(clock)
    pinned.pin(keys(0, 1), 60.0)
    pinned.pin(keys(0, 1), 5.0)
    clock.now += 30.0
    assert pinned.holds(keys(0, 1)[0])


async def parse(body: dict[str, Any], headers: dict[str, str] | None = None, max_ttl: float = 3600.0) -> Any:
    parser = RequestParser(None, tokenize_thread_min_chars=8192, max_pin_ttl_s=max_ttl)
    return await parser.parse(msgspec.json.encode(body), headers or {}, chat=False, model="m", revision="")


async def test_the_router_forwards_a_pin_in_the_body_forms_engines_and_vllm_read() -> None:
    parsed = await parse(
        {"prompt": [1, 2, 3], "kv_transfer_params": {"role": "prefill"}}, {PIN_TTL_HEADER: "90"}
    )
    assert parsed.pin_ttl_s == 90.0
    forwarded = msgspec.json.decode(parsed.raw)
    assert forwarded["kvmesh"] == {"cache_ttl_s": 90.0}
    assert forwarded["kv_transfer_params"] == {"role": "prefill", "kvmesh_cache_ttl_s": 90.0}

    plain = await parse({"prompt": [1, 2, 3]})
    assert plain.pin_ttl_s is None and plain.raw == msgspec.json.encode({"prompt": [1, 2, 3]})


@pytest.mark.parametrize(
    ("body", "headers", "words"),
    [
        ({"kvmesh": {"cache_ttl_s": 0}}, {}, "positive"),
        ({"kvmesh": {"cache_ttl_s": True}}, {}, "number of seconds"),
        ({"kvmesh": {"cache_ttl_s": 7200}}, {}, "maximum of 3600"),
        ({"kvmesh": [60]}, {}, "must be an object"),
        ({}, {PIN_TTL_HEADER: "inf"}, "positive"),
        ({"kvmesh": {"cache_ttl_s": 60}, "kv_transfer_params": {"kvmesh_cache_ttl_s": 61}}, {}, "disagree"),
    ],
)
async def test_a_malformed_pin_is_a_400_from_the_router(
    body: dict[str, Any], headers: dict[str, str], words: str
) -> None:
    with pytest.raises(RequestError) as caught:
        await parse({"prompt": [1, 2, 3], **body}, headers)
    assert caught.value.status == 400 and words in caught.value.message


# ------------------------------------------------------------------ end to end

PINNED = [(i * 7) % 200 + 3 for i in range(600)]  # two 256-token store chunks (32 blocks) and more


def prompt(seed: int) -> list[int]:
    return [(i * seed) % 197 + 5 for i in range(600)]


async def until(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


@pytest.mark.slow
async def test_pinned_blocks_survive_index_pressure_and_refusals_are_relayed(tmp_path: Path) -> None:
    store = tmp_path / "store.yaml"
    store.write_text(
        yaml.safe_dump(
            {
                "shared_dir": str(tmp_path / "shared"),
                "max_pinned_shared_dir_size": 1.0,
                "pin_tenant_budgets": {"frugal": {"fs": 1e-9}},
            }
        )
    )
    opts = EngineOptions(
        model="tiny-random-llama",
        store=str(store),
        events="tcp://127.0.0.1:0",
        events_replay="tcp://127.0.0.1:0",
    )
    engine = await build_engine(opts)
    await engine.start("127.0.0.1", 0)
    raw = {
        "endpoints": [{"url": engine.url}],
        "index": {"capacity": 120},
        "maxPinTtlS": 600,
        "health": {"intervalS": 0.25, "timeoutS": 2.0, "failureThreshold": 3, "metricsIntervalS": 0.5},
    }
    gw = Gateway(router_config_from_dict(raw))
    client = TestClient(TestServer(gw.app))
    await client.start_server()
    try:
        await until(lambda: gw.pool is not None and all(s.healthy for s in gw.pool.states()))

        async def send(tokens: list[int], headers: dict[str, str] | None = None, **extra: Any) -> Any:
            body = {"prompt": tokens, "max_tokens": 1, "temperature": 0, **extra}
            resp = await client.post("/v1/completions", json=body, headers=headers or {})
            return resp.status, await resp.json()

        def shared_blocks(tokens: list[int]) -> int:
            assert gw.applier is not None
            match: PrefixMatch = gw.scheduler.match(RoutingRequest("probe", tokens, gw.applier.namespace()))
            return 0 if match.shared is None else match.shared.num_blocks

        status, reply = await send(PINNED, kvmesh={"cache_ttl_s": 300})
        assert status == 200, reply
        await until(lambda: gw.applier is not None and shared_blocks(PINNED) == 32)
        status, reply = await send(prompt(11))
        assert status == 200, reply
        await until(lambda: shared_blocks(prompt(11)) == 32)

        for seed in range(13, 23):  # ten more prompts: ~700 keys into a 120-key index
            status, reply = await send(prompt(seed))
            assert status == 200, reply
        await until(lambda: shared_blocks(prompt(22)) == 32)
        assert gw.index.stats().num_evicted > 300
        assert shared_blocks(prompt(11)) == 0, "the unpinned prompt survived: the test proves nothing"
        assert shared_blocks(PINNED) == 32, "the router dropped pinned blocks before their deadline"
        assert (
            SHARED_TIER_HOLDER
            in gw.index.lookup(
                gw.scheduler.hasher(gw.applier.namespace()).hash_blocks(PINNED)  # type: ignore[union-attr]
            )[0]
        )

        # The engine's refusal reaches the client as it was given.
        status, reply = await send(prompt(40), kvmesh={"cache_ttl_s": 60}, headers={"x-tenant-id": "frugal"})
        assert status == 429 and "pin budget exceeded" in reply["error"]["message"]
        assert "'frugal'" in reply["error"]["message"]
        # The router's own limit answers before any engine.
        status, reply = await send(prompt(41), kvmesh={"cache_ttl_s": 601})
        assert status == 400 and "maximum of 600" in reply["error"]["message"]
    finally:
        await client.close()
        await engine.stop()
