"""StoreConfig: LMCache YAML, KVMESH_* / LMCACHE_* environment, URL shorthand, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.errors import ConfigError
from kvmesh.store.cache_engine import KVCacheEngine
from kvmesh.store.codec import Codec
from kvmesh.store.config import GB, StoreConfig, config_from_url, load_config, resolve_config
from kvmesh.store.factory import build_tiers

LMCACHE_YAML = """
chunk_size: 256
local_cpu: true
max_local_cpu_size: 2.5
local_disk: "file:///tmp/kvmesh-lmcache-disk"
max_local_disk_size: 10
remote_url: "redis://127.0.0.1:6399"
remote_serde: "cachegen"
save_decode_cache: false
use_layerwise: false
extra_config: {foo: 1}
"""


def test_lmcache_yaml_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text(LMCACHE_YAML)
    config = load_config(path, env={})
    assert config.chunk_size == 256
    assert config.max_local_cpu_size == 2.5
    assert config.local_disk_path() == Path("/tmp/kvmesh-lmcache-disk")
    assert config.resolved_codec() is Codec.INT8
    assert config.ignored_keys == ["extra_config", "save_decode_cache", "use_layerwise"]
    tiers = build_tiers(config)
    assert [t.name for t in tiers] == ["cpu", "disk", "redis"]
    assert tiers[0].backend.capacity_bytes == int(2.5 * GB)  # type: ignore[attr-defined]
    assert [t.queued for t in tiers] == [False, True, True]


def test_environment_overrides_and_precedence(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 256\ncodec: raw\n")
    env = {
        "LMCACHE_CHUNK_SIZE": "128",
        "KVMESH_CHUNK_SIZE": "64",
        "LMCACHE_LOCAL_CPU": "False",
        "KVMESH_CODEC": "fp8",
        "KVMESH_REDIS_TTL_S": "none",
        "KVMESH_REMOTE_TIMEOUT_S": "0.25",
        "KVMESH_SHARED_DIR": str(tmp_path / "shared"),
    }
    config = load_config(path, env=env)
    assert config.chunk_size == 64
    assert config.local_cpu is False
    assert config.resolved_codec() is Codec.FP8
    assert config.redis_ttl_s is None
    assert config.remote_timeout_s == 0.25
    assert [t.name for t in build_tiers(config)] == ["fs"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("chunk_size: 100\n", "multiple of block_size"),
        ("local_disk: /tmp/x\n", "max_local_disk_size"),
        ("remote_url: http://x\n", "remote_url"),
        ("remote_serde: zstd\n", "remote_serde"),
        ("codec: lz4\n", "unknown codec"),
        ("chunk_size: lots\n", "chunk_size"),
        ("- a\n- b\n", "mapping"),
        ("remote_timeout_s: 0\n", "remote_timeout_s"),
    ],
)
def test_bad_values_are_config_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, env={})


def test_missing_file_and_bad_env() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config("/nonexistent/kvmesh.yaml", env={})
    with pytest.raises(ConfigError, match="boolean"):
        load_config(None, env={"KVMESH_LOCAL_CPU": "maybe"})


def test_url_shorthand() -> None:
    assert config_from_url("memory", env={}) == StoreConfig()
    assert config_from_url("valkey://h:1/0", env={}).remote_url == "valkey://h:1/0"
    assert config_from_url("file:///srv/kv", env={}).shared_dir_path() == Path("/srv/kv")
    assert resolve_config("redis://h:2").remote_url == "redis://h:2"
    with pytest.raises(ConfigError, match="unknown store URL"):
        config_from_url("s3://bucket", env={})


def test_url_shorthand_takes_environment_overrides() -> None:
    env = {
        "KVMESH_WRITE_QUEUE_MB": "4096",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "2",
        "KVMESH_SHARED_DIR": "/elsewhere",
        "LMCACHE_REMOTE_URL": "lm://cache:65432",  # LMCache's own, beside kvmesh
        "KVMESH_LOCAL_CPU": "false",
    }
    config = config_from_url("file:///srv/kv", env=env)
    assert config.write_queue_mb == 4096.0
    assert config.max_local_cpu_size == 2.0
    # the URL names the tiers: variables neither move nor add nor remove one
    assert config.shared_dir_path() == Path("/srv/kv")
    assert config.remote_url is None and config.local_cpu is True
    assert config_from_url("memory", env=env).remote_url is None
    with pytest.raises(ConfigError, match="write_queue_mb"):
        config_from_url("memory", env={"KVMESH_WRITE_QUEUE_MB": "lots"})


def test_hmac_key_forms() -> None:
    assert StoreConfig(hmac_key="hex:0aff").hmac_key_bytes() == b"\x0a\xff"
    assert StoreConfig(hmac_key="secret").hmac_key_bytes() == b"secret"
    assert StoreConfig().hmac_key_bytes() is None
    assert StoreConfig(hmac_key="secret").describe()["hmac_key"] == "<set>"


async def test_from_config_none_is_memory_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KVMESH_REMOTE_URL", "KVMESH_LOCAL_DISK", "KVMESH_SHARED_DIR", "LMCACHE_REMOTE_URL"):
        monkeypatch.delenv(var, raising=False)
    engine = KVCacheEngine.from_config(None)
    assert [t.name for t in engine.tiered.tiers] == ["cpu"]
    assert engine.chunk_size == 256
    await engine.aclose()
