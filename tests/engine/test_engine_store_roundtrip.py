"""Real SmolLM2: KV written to a shared-directory store by one engine is served by another process."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp
import pytest

from kvmesh.engine.app import EngineOptions, build_engine

pytestmark = pytest.mark.slow

PROMPT = (
    "You are a careful assistant who answers geography questions in one short sentence. " * 36
    + "Question: which river flows through Paris?"
)


async def complete(http: aiohttp.ClientSession, url: str) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    async with http.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_store_round_trip_across_processes(tmp_path: Path) -> None:
    store_url = f"file://{tmp_path / 'shared'}"
    a = await build_engine(EngineOptions(model="smollm2", store=store_url))
    await a.start("127.0.0.1", 0)
    proc = None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            cold = await complete(http, a.url)
            assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            local = await complete(http, a.url)
            assert local["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert local["choices"][0]["text"] == cold["choices"][0]["text"]
            # Let A's background write reach the shared directory before B looks.
            await a.core.wait_store_writes()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvmesh", "engine", "--model", "smollm2", "--store", store_url,
                "--port", "0", "--num-threads", "1",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )  # fmt: skip
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            assert line, (await proc.stderr.read()).decode() if proc.stderr else ""
            ready = json.loads(line)
            assert ready["store"] is True
            remote = await complete(http, ready["url"])
            n_prompt = cold["usage"]["prompt_tokens"]
            from_store = (n_prompt - 1) // 256 * 256
            assert from_store >= 256
            assert remote["usage"]["prompt_tokens_details"]["cached_tokens"] == from_store
            assert remote["choices"][0]["text"] == cold["choices"][0]["text"]
            async with http.get(f"{ready['url']}/metrics") as r:
                metrics = await r.text()
            shared = [
                ln
                for ln in metrics.splitlines()
                if ln.startswith("kvmesh:cached_tokens_total") and "SHARED" in ln
            ]
            assert [float(ln.rsplit(" ", 1)[1]) for ln in shared] == [from_store]
    finally:
        if proc is not None and proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)
        await a.stop()
