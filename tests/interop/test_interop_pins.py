"""A live vLLM with KVMeshConnector pins a request's prompt when ``kv_transfer_params`` asks: its
chunks lose their TTL in a Valkey running ``volatile-lru`` and enter the tenant's pin ledger, while
an unpinned prompt's chunks keep the ordinary TTL."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from interop_helpers import LiveVllm, stop, wait_healthy

from kvmesh.core.net import free_ports
from kvmesh.fleet.process import ManagedProcess
from kvmesh.fleet.vllm import VllmReplica
from kvmesh.store.local_server import LocalServer

pytestmark = pytest.mark.slow

PINNED = [(i * 7919) % 30000 + 1000 for i in range(600)]
PLAIN = [(i * 104729) % 30000 + 1000 for i in range(600)]
"""Two whole store chunks and a partial one each (token ids: no tokenizer in the way)."""
PREFIX = "kvmesh-pins"
SAVE_WAIT_S = 60.0


@pytest.fixture(scope="module")
def pinning_vllm(
    vllm_available: None, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveVllm, LocalServer]]:
    """One vLLM whose connector stores into a volatile-lru Valkey with a pin budget."""
    folder = tmp_path_factory.mktemp("pins")
    valkey = LocalServer(
        "valkey", maxmemory_bytes=256 << 20, extra_args=["--maxmemory-policy", "volatile-lru"]
    )
    valkey.start()
    store = folder / "store.yaml"
    store.write_text(
        yaml.safe_dump(
            {
                "remote_url": valkey.url,
                "redis_key_prefix": PREFIX,
                "redis_ttl_s": 3600,
                "max_pinned_remote_size": 1.0,
            }
        )
    )
    port, events, replay = free_ports(3)
    replica = VllmReplica(
        name="vllm-pins",
        port=port,
        events_port=events,
        replay_port=replay,
        model_dir=model_dir,
        store=str(store),
        cpu_core=0,  # as every live vLLM here: vLLM's own "auto" binding reads the host's NUMA layout
    )
    live = LiveVllm(
        replica, ManagedProcess(replica.name, replica.argv(), folder / "vllm.log", env=replica.env())
    )
    try:
        live.proc.start()
        wait_healthy(live)
        yield live, valkey
    finally:
        stop(live.proc)
        valkey.close()


def complete(base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    full = {"model": "smollm2", "max_tokens": 1, "temperature": 0, **body}
    req = urllib.request.Request(
        f"{base_url}/v1/completions", json.dumps(full).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return dict(json.loads(resp.read()))


def chunk_ttls(client: redis.Redis) -> list[int]:
    return [int(client.pttl(k)) for k in client.scan_iter(f"{PREFIX}:*") if b":pins:" not in k]


def test_vllm_pins_the_prompt_kv_transfer_params_name(pinning_vllm: tuple[LiveVllm, LocalServer]) -> None:
    live, valkey = pinning_vllm
    client = redis.Redis.from_url(valkey.url.replace("valkey://", "redis://"))
    # vLLM accepts the unknown top-level field and hands kv_transfer_params to the connector.
    reply = complete(
        live.url,
        {"prompt": PINNED, "kvmesh": {"cache_ttl_s": 300}, "kv_transfer_params": {"kvmesh_cache_ttl_s": 300}},
    )
    assert reply["choices"], reply
    deadline = time.monotonic() + SAVE_WAIT_S
    while client.zcard(f"{PREFIX}:pins:exp") < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.zcard(f"{PREFIX}:pins:exp") == 2, "the prompt's two chunks were not pinned"
    assert sorted(chunk_ttls(client)) == [-1, -1], "pinned chunks keep no TTL"

    complete(live.url, {"prompt": PLAIN})
    deadline = time.monotonic() + SAVE_WAIT_S
    while len(chunk_ttls(client)) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    ttls = sorted(chunk_ttls(client))
    assert len(ttls) == 4 and ttls[:2] == [-1, -1] and all(t > 0 for t in ttls[2:]), ttls
    assert client.zcard(f"{PREFIX}:pins:exp") == 2
