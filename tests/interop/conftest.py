"""Live vLLM (the CPU build, in .venv-vllm) for the interop suite.

Two vLLM servers start once per session, sharing a real Valkey through KVMeshConnector and
publishing KV events with replay. Nothing here skips: when vLLM cannot be installed or run, every
test fails with the reason the install script recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from interop_helpers import LiveVllm, stop, wait_healthy

from kvmesh.core.models import resolve_model
from kvmesh.core.net import free_ports
from kvmesh.fleet.process import ManagedProcess
from kvmesh.fleet.vllm import VllmReplica, vllm_unavailable_reason
from kvmesh.store.local_server import LocalServer


@pytest.fixture(scope="session")
def vllm_available() -> None:
    reason = vllm_unavailable_reason()
    if reason is not None:
        pytest.fail(f"real vLLM is required for tests/interop and is unavailable: {reason}", pytrace=False)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model("smollm2").path


@pytest.fixture(scope="session")
def valkey() -> Iterator[LocalServer]:
    server = LocalServer("valkey").start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def vllm_pair(
    vllm_available: None, model_dir: Path, valkey: LocalServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LiveVllm]]:
    """Two vLLM servers, one core each, sharing Valkey through KVMeshConnector, with KV events + replay."""
    logs = tmp_path_factory.mktemp("vllm")
    ports = free_ports(6)
    servers = []
    for i in range(2):
        replica = VllmReplica(
            name=f"vllm-{i}",
            port=ports[3 * i],
            events_port=ports[3 * i + 1],
            replay_port=ports[3 * i + 2],
            model_dir=model_dir,
            store=valkey.url,
            cpu_core=i % 2,
            max_model_len=8192,  # SmolLM2's whole context: the prewarm test's document fills it
        )
        proc = ManagedProcess(replica.name, replica.argv(), logs / f"{replica.name}.log", env=replica.env())
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
