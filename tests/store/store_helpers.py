"""Helpers shared by the store tests (a uniquely named module, importable from any test file here)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kvmesh.core.types import BlockKey
from kvmesh.errors import TierUnavailableError
from kvmesh.store.backends.base import Backend, BackendStats
from kvmesh.store.backends.disk import DiskBackend
from kvmesh.store.backends.fs import SharedDirBackend
from kvmesh.store.backends.memory import MemoryBackend
from kvmesh.store.backends.redis import RedisBackend
from kvmesh.store.codec import ChunkCodec
from kvmesh.store.keys import StoreKey
from kvmesh.store.local_server import LocalServer


def make_key(i: int, group: str = "00000000000000aa") -> StoreKey:
    return StoreKey(group, BlockKey(i.to_bytes(16, "big")))


def make_value(i: int, size: int = 256) -> bytes:
    return np.random.default_rng(i).bytes(size)


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def make_chunk(key: StoreKey, tokens: int = 4, seed: int = 0) -> bytes:
    """A valid raw float32 chunk for ``key``."""
    kv = np.random.default_rng(seed).standard_normal((1, 2, 2, tokens, 8)).astype(np.float32)
    return ChunkCodec().encode(key, kv)


def corrupt_bytes(data: bytes, mode: str, seed: int = 0) -> bytes:
    """A bit flip somewhere in the chunk, or a truncation."""
    rng = np.random.default_rng(seed)
    if mode == "truncate":
        return data[: int(rng.integers(0, len(data)))]
    buf = bytearray(data)
    pos = int(rng.integers(0, len(buf) * 8))
    buf[pos // 8] ^= 1 << (pos % 8)
    return bytes(buf)


class FlakyBackend:
    """A memory backend whose calls can be made to fail or hang, and that counts calls."""

    def __init__(self, capacity: int = 1 << 30, kind: str = "flaky") -> None:
        self.inner = MemoryBackend(capacity)
        self.kind = kind
        self.fail = False
        self.delay_s = 0.0
        self.calls: dict[str, int] = {}
        self.keys_fetched: list[StoreKey] = []

    async def _enter(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            raise TierUnavailableError(f"injected failure in {op}")

    async def exists_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        await self._enter("exists")
        return await self.inner.exists_many(keys)

    async def get_many(self, keys: Sequence[StoreKey]) -> list[bytes | None]:
        await self._enter("get")
        self.keys_fetched.extend(keys)
        return await self.inner.get_many(keys)

    async def put_many(self, items: Sequence[tuple[StoreKey, bytes]]) -> int:
        await self._enter("put")
        return await self.inner.put_many(items)

    async def delete_many(self, keys: Sequence[StoreKey]) -> int:
        await self._enter("delete")
        return await self.inner.delete_many(keys)

    async def flush(self, group: str | None = None) -> int:
        await self._enter("flush")
        return await self.inner.flush(group)

    async def stats(self) -> BackendStats:
        await self._enter("stats")
        return await self.inner.stats()

    async def aclose(self) -> None:
        await self.inner.aclose()


def build_backend(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, capacity: int = 1 << 30
) -> Backend:
    if kind == "memory":
        return MemoryBackend(capacity)
    if kind in ("disk", "disk-copied"):
        return DiskBackend(tmp_path / "disk", capacity, mapped=kind == "disk")
    if kind in ("fs", "fs-copied"):
        return SharedDirBackend(tmp_path / "shared", mapped=kind == "fs")
    server: LocalServer = request.getfixturevalue(f"{kind}_server")
    return RedisBackend(server.url, key_prefix=unique_prefix())


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too (Redis Cluster needs ≤ 55535)."""
    rng = np.random.default_rng()
    for _ in range(200):
        port = int(rng.integers(20_000, 45_000))
        if _port_free(port) and _port_free(port + 10_000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class LocalCluster:
    """Three redis-server masters joined into a Redis Cluster with redis-cli."""

    def __init__(self) -> None:
        self.nodes = [
            LocalServer(
                "redis",
                port=_cluster_port(),
                extra_args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ],
            )
            for _ in range(3)
        ]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> LocalCluster:
        cli = shutil.which("redis-cli")
        if cli is None:
            pytest.skip("redis-cli not found; apt-get install redis-server (scripts/system-deps.sh)")
        try:
            return self._start(cli)
        except BaseException:
            self.close()
            raise

    def _start(self, cli: str) -> LocalCluster:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            states = [
                subprocess.run(
                    [cli, "-p", str(node.port), "cluster", "info"], capture_output=True, timeout=5, text=True
                ).stdout
                for node in self.nodes
            ]
            if all("cluster_state:ok" in state for state in states):
                return self
            time.sleep(0.1)
        raise RuntimeError("redis cluster did not reach cluster_state:ok")

    def close(self) -> None:
        for node in self.nodes:
            node.close()
