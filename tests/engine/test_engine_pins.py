"""Pins through the engine's HTTP API: emulated engines on a real shared directory.

The KV values do not matter here (placeholder chunks); what is checked is which requests may pin,
what the store's ledger holds afterwards, and the answers a refused request gets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvmesh.core.pins import PIN_TTL_HEADER
from kvmesh.engine.server import EngineServer
from kvmesh.store.backends.fs_pins import PINS_DIR
from kvmesh.store.pins import GB, tenant_id

CHUNK = 256
PROMPT = [(i * 7) % 200 + 3 for i in range(3 * CHUNK)]
OTHER = [(i * 11) % 200 + 3 for i in range(2 * CHUNK)]
QWEN = "qwen3-32b-h100-tp2"


def store_yaml(tmp_path: Path, budget_bytes: int, **extra: object) -> str:
    path = tmp_path / "store.yaml"
    config = {
        "shared_dir": str(tmp_path / "shared"),
        "max_pinned_shared_dir_size": budget_bytes / GB,
        "pin_max_ttl_s": 600,
        **extra,
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


async def post(
    server: EngineServer, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    full = {"max_tokens": 1, "temperature": 0, "ignore_eos": True, **body}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
        http.post(f"{server.url}/v1/completions", json=full, headers=headers or {}) as r,
    ):
        return r.status, await r.json()


def pins_of(shared: Path, tenant: str) -> dict[str, float]:
    folder = shared / PINS_DIR / tenant_id(tenant)
    if not folder.is_dir():
        return {}
    return {p.name: p.stat().st_mtime for p in folder.iterdir() if not p.name.startswith(".")}


async def test_a_request_pins_its_prompt_in_the_shared_tier_until_its_ttl(
    make_engine: Callable[..., Any], tmp_path: Path
) -> None:
    server = await make_engine(QWEN, store=store_yaml(tmp_path, 1 << 20))
    began = time.time()
    status, reply = await post(
        server, {"prompt": PROMPT, "kvmesh": {"cache_ttl_s": 120}}, {"x-tenant-id": "acme"}
    )
    assert status == 200, reply
    await server.core.wait_store_writes()
    pins = await asyncio.to_thread(pins_of, tmp_path / "shared", "acme")
    assert len(pins) == 3, "one pin per full chunk of the prompt"
    assert all(began + 119 <= deadline <= time.time() + 121 for deadline in pins.values())

    # The header names the same pin; a second request re-pins (extends) without new markers.
    status, reply = await post(server, {"prompt": PROMPT}, {"x-tenant-id": "acme", PIN_TTL_HEADER: "300"})
    assert status == 200, reply
    await server.core.wait_store_writes()
    later = await asyncio.to_thread(pins_of, tmp_path / "shared", "acme")
    assert later.keys() == pins.keys() and all(later[k] > pins[k] + 170 for k in pins)


async def test_a_prefill_request_reports_its_pins(make_engine: Callable[..., Any], tmp_path: Path) -> None:
    server = await make_engine(QWEN, store=store_yaml(tmp_path, 1 << 20))
    status, reply = await post(
        server, {"prompt": OTHER, "kv_transfer_params": {"role": "prefill", "kvmesh_cache_ttl_s": 60}}
    )
    assert status == 200, reply
    (pin,) = reply["kv_transfer_params"]["kvmesh_pins"]
    assert pin["tier"] == "fs" and pin["accepted"] and pin["expires_at"] > time.time() + 50


async def test_a_pin_over_the_tenants_budget_is_refused_before_any_work(
    make_engine: Callable[..., Any], tmp_path: Path
) -> None:
    # Placeholder chunks are about 1.2 KB: four fit, five do not.
    server = await make_engine(QWEN, store=store_yaml(tmp_path, 5000))
    acme = {"x-tenant-id": "acme"}
    status, reply = await post(server, {"prompt": PROMPT, "kvmesh": {"cache_ttl_s": 60}}, acme)
    assert status == 200, reply
    await server.core.wait_store_writes()
    steps = server.core.runner.num_steps

    status, reply = await post(server, {"prompt": OTHER, "kvmesh": {"cache_ttl_s": 60}}, acme)
    assert status == 429 and reply["error"]["type"] == "RateLimitError"
    message = reply["error"]["message"]
    assert (
        "pin budget exceeded" in message and "'acme'" in message and "'fs'" in message and "5000" in message
    )
    assert server.core.runner.num_steps == steps, "a refused pin ran"
    assert len(await asyncio.to_thread(pins_of, tmp_path / "shared", "acme")) == 3

    # Another tenant has its own budget.
    status, reply = await post(
        server, {"prompt": OTHER, "kvmesh": {"cache_ttl_s": 60}}, {"x-tenant-id": "beta"}
    )
    assert status == 200, reply


async def test_malformed_or_unpayable_pins_get_clear_4xx(
    make_engine: Callable[..., Any], tmp_path: Path
) -> None:
    server = await make_engine(QWEN, store=store_yaml(tmp_path, 1 << 20))
    cases = [
        ({"kvmesh": {"cache_ttl_s": -5}}, {}, 400, "positive"),
        ({"kvmesh": {"cache_ttl_s": "soon"}}, {}, 400, "number of seconds"),
        ({"kvmesh": {"cache_ttl_s": 601}}, {}, 400, "maximum of 600"),
        ({"kvmesh": {"cache_ttl_s": 60}}, {PIN_TTL_HEADER: "30"}, 400, "disagree"),
        ({"kvmesh": "forever"}, {}, 400, "kvmesh"),
    ]
    for extra, headers, status, words in cases:
        got, reply = await post(server, {"prompt": PROMPT, **extra}, headers)
        assert got == status and words in reply["error"]["message"], (extra, reply)

    bare = await make_engine(QWEN, store=f"file://{tmp_path / 'other'}")
    got, reply = await post(bare, {"prompt": PROMPT, "kvmesh": {"cache_ttl_s": 60}})
    assert got == 429 and "no pin budget" in reply["error"]["message"]
