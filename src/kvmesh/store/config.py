"""Store configuration: YAML, ``KVMESH_*`` environment variables, URL shorthand.

LMCache's key names are accepted with LMCache's meaning, so an ``lmcache.yaml`` works unchanged:

==================== ===================================================================
``chunk_size``       tokens per chunk (default 256; a multiple of ``block_size``)
``local_cpu``        keep a RAM tier (default true)
``max_local_cpu_size`` RAM tier budget in GB (2^30 bytes, as LMCache counts; default 5)
``local_disk``       local disk tier directory: ``"file:///path"`` or a plain path
``max_local_disk_size`` disk tier budget in GB (required with ``local_disk``)
``remote_url``       ``redis://``, ``rediss://``, ``valkey://``, ``redis+cluster://`` …
``remote_serde``     ``naive`` → codec ``raw``; ``cachegen`` → codec ``int8``
==================== ===================================================================

Other LMCache keys (``use_layerwise``, ``save_decode_cache``, ``extra_config`` …) are ignored and
listed in :attr:`StoreConfig.ignored_keys`. kvmesh's own keys are the remaining fields of
:class:`StoreConfig`. Every field can also be set by ``KVMESH_<FIELD>`` (upper case); LMCache's
names are read from ``LMCACHE_<KEY>`` as well, with ``KVMESH_`` taking precedence.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import msgspec
import yaml

from kvmesh.errors import ConfigError
from kvmesh.store.backends.redis import is_redis_url
from kvmesh.store.codec import Codec
from kvmesh.store.pins import PinBudgets

GB = 1 << 30
LMCACHE_KEYS = frozenset(
    {
        "chunk_size",
        "local_cpu",
        "max_local_cpu_size",
        "local_disk",
        "max_local_disk_size",
        "remote_url",
        "remote_serde",
    }
)
PIN_TIERS = frozenset({"cpu", "redis", "fs"})
"""Tiers that can pin (the shared tiers, and the RAM tier best effort)."""
_SERDE = {"naive": "raw", "cachegen": "int8", "raw": "raw", "int8": "int8", "fp8": "fp8"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class StoreConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything needed to build a store. Sizes in GB are 2^30 bytes."""

    chunk_size: int = 256
    block_size: int = 16
    hash_algo: str = "sha256"
    local_cpu: bool = True
    max_local_cpu_size: float = 5.0
    local_disk: str | None = None
    max_local_disk_size: float = 0.0
    remote_url: str | None = None
    remote_serde: str | None = None
    shared_dir: str | None = None
    """Shared directory tier: ``"file:///path"`` or a plain path."""
    codec: str | None = None
    """raw | int8 | fp8; defaults to what ``remote_serde`` maps to, else raw."""
    hmac_key: str | None = None
    """Fleet key for chunk HMACs; ``"hex:<hex digits>"`` or plain text."""
    kv_dtype: str = ""
    """KV dtype that fills store namespaces which do not carry one (see ``Namespace.for_store``)."""
    kv_layout: str = ""
    disk_timeout_s: float = 5.0
    remote_timeout_s: float = 1.0
    breaker_failures: int = 3
    breaker_backoff_s: float = 0.5
    breaker_max_backoff_s: float = 30.0
    write_queue_mb: float = 2048.0
    """Per-tier cap of encoded bytes waiting to be written (MB = 2^20 bytes). A write that would
    take the queue past it is dropped whole (its chunks are recomputed where needed), unless nothing
    else is queued: one prompt larger than the cap is still written to an idle tier. One 8k-token
    prompt of an 8B model in bfloat16 is 1 GiB of KV."""
    redis_key_prefix: str = "kvmesh"
    redis_ttl_s: float | None = None
    redis_max_connections: int = 32
    disk_fsync: bool = False
    mmap_reads: bool | None = None
    """Map chunk files of the disk and shared-directory tiers rather than copy them; default (unset):
    where the directory is memory-backed (tmpfs such as ``/dev/shm``). A copy costs a fresh
    allocation per chunk, whose page faults make it several times slower than the mapping; but a
    disk's I/O error, or a file truncated in place by another program, under a mapping is a
    ``SIGBUS`` that ends the process, where a copying read is a miss."""
    max_shared_dir_size: float = 0.0
    """Shared directory budget in GB: writers evict its oldest unpinned chunks past it; 0 (the
    default) leaves sizing to whoever provisions the directory."""
    pin_max_ttl_s: float = 86400.0
    """Longest pin a request may ask for (``{"kvmesh": {"cache_ttl_s": N}}``), in seconds."""
    max_pinned_remote_size: float = 0.0
    """GB each tenant may pin in the Redis/Valkey tier (0: no pins there)."""
    max_pinned_shared_dir_size: float = 0.0
    """GB each tenant may pin in the shared directory tier (0: no pins there)."""
    max_pinned_local_cpu_size: float = 0.0
    """GB each tenant may pin in this process's RAM tier (0: no pins there; best effort: kept by
    the tier's LRU while they fit, forgotten at a restart)."""
    pin_tenant_budgets: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    """Per tenant, per tier (``cpu``, ``redis``, ``fs``), a pin budget in GB replacing the ones above."""
    ignored_keys: list[str] = msgspec.field(default_factory=list)
    """Keys of the source file that kvmesh does not use (LMCache options without a kvmesh meaning)."""

    def __post_init__(self) -> None:
        if self.chunk_size <= 0 or self.block_size <= 0 or self.chunk_size % self.block_size:
            raise ConfigError(
                f"chunk_size must be a positive multiple of block_size={self.block_size}, got {self.chunk_size}"
            )
        if self.local_cpu and self.max_local_cpu_size <= 0:
            raise ConfigError(f"max_local_cpu_size must be > 0 GB, got {self.max_local_cpu_size}")
        if self.local_disk and self.max_local_disk_size <= 0:
            raise ConfigError("local_disk needs max_local_disk_size > 0 (GB)")
        if self.remote_url and not is_redis_url(self.remote_url):
            raise ConfigError(
                f"remote_url must be a redis://, rediss:// or valkey:// URL, got {self.remote_url!r}"
            )
        if self.remote_serde is not None and self.remote_serde.lower() not in _SERDE:
            raise ConfigError(f"remote_serde must be one of {sorted(_SERDE)}, got {self.remote_serde!r}")
        try:
            self.resolved_codec()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        for name in ("disk_timeout_s", "remote_timeout_s", "breaker_backoff_s", "write_queue_mb"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "max_shared_dir_size",
            "max_pinned_remote_size",
            "max_pinned_shared_dir_size",
            "max_pinned_local_cpu_size",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 GB, got {getattr(self, name)}")
        if self.pin_max_ttl_s <= 0:
            raise ConfigError(f"pin_max_ttl_s must be > 0, got {self.pin_max_ttl_s}")
        for tenant, budgets in self.pin_tenant_budgets.items():
            for tier, gb in budgets.items():
                if tier not in PIN_TIERS or gb < 0:
                    raise ConfigError(
                        f"pin_tenant_budgets[{tenant!r}]: expected tiers {sorted(PIN_TIERS)} with GB >= 0, "
                        f"got {tier!r}: {gb}"
                    )
        if self.breaker_failures < 1:
            raise ConfigError(f"breaker_failures must be ≥ 1, got {self.breaker_failures}")

    def pin_budgets(self) -> PinBudgets:
        """Each tenant's pin budget per tier."""
        return PinBudgets(
            {
                "cpu": self.max_pinned_local_cpu_size,
                "redis": self.max_pinned_remote_size,
                "fs": self.max_pinned_shared_dir_size,
            },
            self.pin_tenant_budgets,
        )

    def resolved_codec(self) -> Codec:
        """The codec chunks are written with."""
        if self.codec:
            return Codec.parse(self.codec)
        if self.remote_serde:
            return Codec(_SERDE[self.remote_serde.lower()])
        return Codec.RAW

    def hmac_key_bytes(self) -> bytes | None:
        """The fleet key as bytes (``hex:`` prefix decoded)."""
        if not self.hmac_key:
            return None
        if self.hmac_key.startswith("hex:"):
            try:
                return bytes.fromhex(self.hmac_key[4:])
            except ValueError as exc:
                raise ConfigError(f"hmac_key: bad hex: {exc}") from exc
        return self.hmac_key.encode("utf-8")

    def local_disk_path(self) -> Path | None:
        return None if not self.local_disk else path_from_url(self.local_disk)

    def shared_dir_path(self) -> Path | None:
        return None if not self.shared_dir else path_from_url(self.shared_dir)

    def describe(self) -> dict[str, Any]:
        """The configuration as plain data, with the HMAC key redacted."""
        data = msgspec.to_builtins(self)
        if data.get("hmac_key"):
            data["hmac_key"] = "<set>"
        return dict(data)


def path_from_url(value: str) -> Path:
    """``file:///a/b`` or ``/a/b`` → ``Path("/a/b")``.

    Raises:
        ConfigError: another URL scheme, or a ``file://`` URL with a host.
    """
    if "://" not in value:
        return Path(value).expanduser()
    parts = urlsplit(value)
    if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
        raise ConfigError(f"expected a file:///path URL or a path, got {value!r}")
    return Path(unquote(parts.path))


def _fields() -> dict[str, Any]:
    return {f.name: f.type for f in msgspec.structs.fields(StoreConfig) if f.name != "ignored_keys"}


def _parse_env_value(name: str, raw: str, kind: Any) -> Any:
    text = raw.strip()
    kind_text = str(kind)
    if "None" in kind_text and text.lower() in {"", "none", "null"}:
        return None
    if kind is bool or kind_text in ("bool", "bool | None"):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"{name}: expected a boolean, got {raw!r}")
    return text


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """Fields set by ``LMCACHE_<KEY>`` (LMCache names only) and ``KVMESH_<FIELD>`` (wins)."""
    out: dict[str, Any] = {}
    fields = _fields()
    for prefix, names in (("LMCACHE_", LMCACHE_KEYS), ("KVMESH_", fields.keys())):
        for name in names:
            var = prefix + name.upper()
            if var in env:
                out[name] = _parse_env_value(var, env[var], fields[name])
    return out


def config_from_mapping(data: Mapping[str, Any], *, source: str = "config") -> StoreConfig:
    """Build a config from a parsed YAML mapping; unknown keys are recorded, not fatal.

    Raises:
        ConfigError: a known key has a bad value.
    """
    known = _fields()
    kept = {k: v for k, v in data.items() if k in known}
    ignored = sorted(str(k) for k in data if k not in known)
    try:
        config = msgspec.convert(kept, StoreConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    config.ignored_keys = ignored
    return config


def load_config(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> StoreConfig:
    """Read a YAML file (or nothing) and apply environment overrides.

    Args:
        path: YAML file; ``None`` starts from the defaults (a RAM tier only).
        env: variables to read (``os.environ`` when ``None``).

    Raises:
        ConfigError: unreadable file, not a mapping, or a bad value.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read store config {path}: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the store config must be a mapping, got {type(loaded).__name__}")
        data.update(loaded)
    data.update(env_overrides(os.environ if env is None else env))
    return config_from_mapping(data, source=source)


TIER_FIELDS = frozenset({"remote_url", "shared_dir", "local_disk", "local_cpu"})
"""Fields that choose tiers: a URL shorthand names its tiers itself."""


def config_from_url(url: str, env: Mapping[str, str] | None = None) -> StoreConfig:
    """URL shorthand: ``memory``, ``redis://…`` / ``valkey://…`` (RAM + remote), ``file:///dir``
    (RAM + shared directory). ``KVMESH_*`` / ``LMCACHE_*`` variables tune it (queue, timeouts,
    codec, sizes) as they do a YAML file, but do not add or change tiers (:data:`TIER_FIELDS`):
    ``LMCACHE_REMOTE_URL`` set for LMCache beside kvmesh leaves ``--store file:///dir`` as it is.

    Raises:
        ConfigError: an unknown shorthand, or a bad variable value.
    """
    overrides = env_overrides(os.environ if env is None else env)
    data = {k: v for k, v in overrides.items() if k not in TIER_FIELDS}
    if url == "memory":
        pass
    elif is_redis_url(url):
        data["remote_url"] = url
    elif url.startswith("file://"):
        data["shared_dir"] = url
    else:
        raise ConfigError(f"unknown store URL {url!r}: expected memory, redis://, valkey:// or file:///dir")
    return config_from_mapping(data, source=url)


def resolve_config(config: StoreConfig | str | os.PathLike[str] | None) -> StoreConfig:
    """What ``KVCacheEngine.from_config`` accepts: a config, a URL shorthand, a YAML path or ``None``."""
    if isinstance(config, StoreConfig):
        return config
    if config is None:
        return load_config(None)
    text = os.fspath(config)
    if text == "memory" or "://" in text:
        return config_from_url(text)
    return load_config(text)
