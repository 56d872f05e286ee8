"""Build a :class:`~kvmesh.store.tiered.TieredStore` from a :class:`~kvmesh.store.config.StoreConfig`.

Tier order (fastest first): ``cpu`` (RAM, written inline), ``disk``, ``redis``, ``fs`` (each written
by its own queue worker). Valkey servers appear as tier ``redis``: same protocol, same costs.
"""

from __future__ import annotations

from kvmesh.store.backends.disk import DiskBackend
from kvmesh.store.backends.fs import SharedDirBackend
from kvmesh.store.backends.memory import MemoryBackend
from kvmesh.store.backends.redis import RedisBackend
from kvmesh.store.breaker import CircuitBreaker
from kvmesh.store.codec import ChunkCodec
from kvmesh.store.config import GB, StoreConfig
from kvmesh.store.metrics import StoreMetrics
from kvmesh.store.tiered import Tier, TieredStore

LOCAL_TIERS = frozenset({"cpu", "disk"})
"""Tiers private to one process (its RAM and local disk); the others are shared by the fleet."""


def _breaker(config: StoreConfig) -> CircuitBreaker:
    return CircuitBreaker(
        failure_threshold=config.breaker_failures,
        backoff_s=config.breaker_backoff_s,
        max_backoff_s=max(config.breaker_max_backoff_s, config.breaker_backoff_s),
    )


def build_tiers(config: StoreConfig) -> list[Tier]:
    """The tiers ``config`` asks for, fastest first (may be empty)."""
    queue_bytes = int(config.write_queue_mb * (1 << 20))
    tiers: list[Tier] = []
    if config.local_cpu:
        tiers.append(
            Tier("cpu", MemoryBackend(int(config.max_local_cpu_size * GB)), breaker=_breaker(config))
        )
    disk_path = config.local_disk_path()
    if disk_path is not None:
        backend = DiskBackend(
            disk_path, int(config.max_local_disk_size * GB), fsync=config.disk_fsync, mapped=config.mmap_reads
        )
        tiers.append(
            Tier(
                "disk",
                backend,
                timeout_s=config.disk_timeout_s,
                breaker=_breaker(config),
                queued=True,
                max_queue_bytes=queue_bytes,
            )
        )
    if config.remote_url:
        redis = RedisBackend(
            config.remote_url,
            key_prefix=config.redis_key_prefix,
            ttl_s=config.redis_ttl_s,
            socket_timeout_s=max(config.remote_timeout_s * 2, 1.0),
            max_connections=config.redis_max_connections,
        )
        tiers.append(
            Tier(
                "redis",
                redis,
                timeout_s=config.remote_timeout_s,
                breaker=_breaker(config),
                queued=True,
                max_queue_bytes=queue_bytes,
            )
        )
    shared = config.shared_dir_path()
    if shared is not None:
        tiers.append(
            Tier(
                "fs",
                SharedDirBackend(
                    shared,
                    fsync=config.disk_fsync,
                    mapped=config.mmap_reads,
                    max_bytes=int(config.max_shared_dir_size * GB),
                ),
                timeout_s=config.remote_timeout_s,
                breaker=_breaker(config),
                queued=True,
                max_queue_bytes=queue_bytes,
            )
        )
    return tiers


def build_store(config: StoreConfig, metrics: StoreMetrics | None = None) -> TieredStore:
    """A TieredStore with the configured tiers and codec."""
    codec = ChunkCodec(config.resolved_codec(), config.hmac_key_bytes())
    return TieredStore(build_tiers(config), codec, metrics)
