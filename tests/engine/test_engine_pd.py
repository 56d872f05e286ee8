"""Prefill/decode disaggregation through a shared-directory store, with real KV (tiny random Llama)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from kvmesh.core.tenancy import Role
from kvmesh.engine.app import EngineOptions, build_engine

pytestmark = pytest.mark.slow


async def test_prefill_engine_writes_decode_engine_loads(tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'shared'}"
    prefill = await build_engine(EngineOptions(model="tiny-random-llama", store=store, role=Role.PREFILL))
    decode = await build_engine(EngineOptions(model="tiny-random-llama", store=store, role=Role.DECODE))
    await prefill.start()
    await decode.start()
    prompt = [(i * 7) % 200 + 3 for i in range(600)]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{prefill.url}/v1/completions", json={**body, "kv_transfer_params": {"role": "prefill"}}
            ) as r:
                p = await r.json()
            assert r.status == 200, p
            assert p["usage"]["completion_tokens"] == 1
            assert p["kv_transfer_params"]["role"] == "prefill"
            # The prefill response comes back only once the chunks are in the shared tier.
            async with http.post(
                f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": {"role": "decode"}}
            ) as r:
                d = await r.json()
            assert r.status == 200, d
            assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
            assert d["kv_transfer_params"]["cached_tier"] == "SHARED"
            # The same prompt computed cold (another tenant: nothing cached) gives the same tokens.
            async with http.post(f"{decode.url}/v1/completions", json={**body, "cache_salt": "cold"}) as r:
                cold = await r.json()
            assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert d["choices"][0]["text"] == cold["choices"][0]["text"]
            assert d["usage"]["completion_tokens"] == 12
    finally:
        await prefill.stop()
        await decode.stop()
