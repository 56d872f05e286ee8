"""``kvmesh store flush | stats | bench`` end to end (in-process, real redis-server and files)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from store_helpers import unique_prefix

from kvmesh.cli import main
from kvmesh.core.hashing import Namespace
from kvmesh.store.cache_engine import KVCacheEngine
from kvmesh.store.local_server import LocalServer


def _write_config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "store.yaml"
    path.write_text(
        f"chunk_size: 32\nremote_url: {url}\nredis_key_prefix: {unique_prefix()}\n"
        f"local_disk: file://{tmp_path}/disk\nmax_local_disk_size: 0.01\nshared_dir: {tmp_path}/shared\n"
    )
    return path


def _fill(config: Path) -> None:
    async def run() -> None:
        engine = KVCacheEngine.from_config(str(config))
        kv = np.ones((1, 2, 1, 64, 4), np.float32)
        for model in ("a", "b"):
            await engine.store(list(range(64)), Namespace(model), kv)
        await engine.aclose()

    asyncio.run(run())


def test_flush_and_stats(
    tmp_path: Path, redis_server: LocalServer, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _write_config(tmp_path, redis_server.url)
    _fill(config)
    assert main(["store", "stats", "--config", str(config), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert set(stats["tiers"]) == {"disk", "redis", "fs"}
    assert stats["tiers"]["disk"]["backend"]["num_chunks"] == 4
    assert stats["tiers"]["fs"]["backend"]["num_chunks"] == 4

    assert main(["store", "flush", "--config", str(config), "--model", "a", "--json"]) == 0
    flushed = json.loads(capsys.readouterr().out)
    assert flushed["removed"] == {"disk": 2, "redis": 2, "fs": 2}
    assert main(["store", "flush", "--config", str(config), "--all"]) == 0
    assert "2 chunks removed" in capsys.readouterr().out

    assert main(["store", "stats", "--config", str(config)]) == 0
    assert "kvmesh store tiers" in capsys.readouterr().out


def test_flush_argument_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "flush", "--config", "memory", "--all"]) == 2
    assert "no persistent tier" in capsys.readouterr().err
    assert main(["store", "flush", "--config", "memory"]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["store", "stats", "--config", "/nonexistent.yaml"]) == 2


def test_flush_reports_unreachable_tier(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "flush", "--config", "redis://127.0.0.1:1/0", "--all"]) == 1
    assert "unreachable" in capsys.readouterr().out


def test_bench_json(tmp_path: Path, redis_server: LocalServer, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["store", "bench", "--json", "--shape", "smollm2-135m", "--chunk-tokens", "32", "--chunks", "2"]
    argv += [
        "--iterations",
        "1",
        "--tiers",
        "cpu,disk,redis",
        "--redis-url",
        redis_server.url,
        "--dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(r["tier"], r["op"]): r for r in report["rows"]}
    assert set(rows) == {
        ("cpu", "put"),
        ("cpu", "get"),
        ("cpu", "retrieve"),
        ("disk", "put"),
        ("disk", "get"),
        ("redis", "put"),
        ("redis", "get"),
    }
    assert rows[("redis", "get")]["baseline"] == "redis-py pipelined GET"
    assert all(r["gbps"] > 0 and r["baseline_gbps"] > 0 for r in rows.values())
    assert report["kv_shape"] == [30, 2, 3, 32, 64]
    assert list(tmp_path.iterdir()) == []  # the --dir given keeps nothing of the run


def test_bench_rejects_unknown_tier(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "bench", "--tiers", "cpu,tape"]) == 2
    assert "unknown tiers" in capsys.readouterr().err
