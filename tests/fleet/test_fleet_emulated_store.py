"""An emulated fleet with ``emulated_store``: engines (``kvmesh engine`` processes) share the fleet's
directory tier behind the router; without it they get no ``--store``, as before."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from kvmesh.engine.cost_model import PRESETS
from kvmesh.fleet import Fleet, FleetConfig

CHUNK = 256
PROMPT = [(i * 7) % 200 + 3 for i in range(4 * CHUNK)]
SUFFIX = [(i * 13) % 200 + 3 for i in range(100)]


@pytest.mark.parametrize(
    ("emulate", "emulated_store", "gets_store"),
    [(None, False, True), ("tiny-h100", False, False), ("tiny-h100", True, True)],
)
async def test_emulated_engines_get_the_shared_tier_only_when_asked(
    tmp_path: Path, emulate: str | None, emulated_store: bool, gets_store: bool
) -> None:
    config = FleetConfig(emulate=emulate, emulated_store=emulated_store, shared="dir", run_dir=tmp_path)
    fleet = Fleet(config)
    await fleet._start_shared_tier()
    argv = fleet._engine_argv(8001, None)
    assert ("--store" in argv) is gets_store
    if gets_store:
        assert argv[argv.index("--store") + 1] == (tmp_path / "shared").resolve().as_uri()
    await fleet.aclose()


def test_emulated_store_needs_a_shared_tier() -> None:
    with pytest.raises(ValueError, match="emulated_store needs a shared tier"):
        FleetConfig(emulate="tiny-h100", emulated_store=True, shared="none")


async def _complete(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> int:
    body = {"model": PRESETS["tiny-h100"].model.name, "prompt": prompt, "max_tokens": 1, "ignore_eos": True}
    async with http.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        reply = await r.json()
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.slow
async def test_an_emulated_fleet_shares_prompts_through_its_directory_tier(tmp_path: Path) -> None:
    config = FleetConfig(
        num_engines=2,
        model="tiny-random-llama",
        emulate="tiny-h100",
        shared="dir",
        emulated_store=True,
        policy="precise",
        run_dir=tmp_path,
        health_timeout_s=120,
    )
    shared = tmp_path / "shared"
    async with Fleet(config) as fleet, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        first, second = fleet.engine_urls
        assert await _complete(http, first, PROMPT) == 0
        deadline = time.monotonic() + 30
        while len(list(shared.rglob("*.kvc"))) < 4:
            assert time.monotonic() < deadline, "the first engine's chunks never reached the shared tier"
            await asyncio.sleep(0.05)
        assert await _complete(http, second, PROMPT + SUFFIX) == 4 * CHUNK
        async with http.get(f"{second}/metrics") as r:
            metrics = await r.text()
        assert any(
            line.startswith("kvmesh:cached_tokens_total{")
            and 'tier="SHARED"' in line
            and line.endswith(" 1024.0")
            for line in metrics.splitlines()
        ), metrics
        # Through the router: a third prompt sharing the prefix is served from a cache too.
        assert await _complete(http, fleet.url, PROMPT + SUFFIX[:50]) >= 4 * CHUNK
