"""Build a :class:`~kvmesh.store.tiered.TieredStore` from a :class:`~kvmesh.store.config.StoreConfig`.

Tier order (fastest first): ``cpu`` (RAM, written inline), ``disk``, ``redis``, ``fs`` (each written
by its own queue worker). Valkey servers appear as tier ``redis``: same protocol, same costs.
"""

from __future__ import annotations

from kvmesh.store.backends.base import Backend
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


def _queued_tier(name: str, backend: Backend, timeout_s: float, config: StoreConfig) -> Tier:
    """A tier written by its own queue worker, each call bounded by ``timeout_s``."""
    return Tier(
        name,
        backend,
        timeout_s=timeout_s,
        breaker=_breaker(config),
        queued=True,
        max_queue_bytes=int(config.write_queue_mb * (1 << 20)),
    )


def redis_socket_timeout_s(config: StoreConfig) -> float:
    """The Redis client's own socket limit: a backstop, ten times the tier's timeout. The tiered store
    decides when a call failed, with limits that grow with the bytes moved (a background load of a
    long prefix may take tens of seconds); one reply of a large read stalled past a tight socket
    limit on a busy machine turned such a load into a recompute many times slower."""
    return max(config.remote_timeout_s * 10, 5.0)


def build_tiers(config: StoreConfig) -> list[Tier]:
    """The tiers ``config`` asks for, fastest first (may be empty)."""
    tiers: list[Tier] = []
    if config.local_cpu:
        tiers.append(
            Tier("cpu", MemoryBackend(int(config.max_local_cpu_size * GB)), breaker=_breaker(config))
        )
    disk_path = config.local_disk_path()
    if disk_path is not None:
        disk = DiskBackend(
            disk_path, int(config.max_local_disk_size * GB), fsync=config.disk_fsync, mapped=config.mmap_reads
        )
        tiers.append(_queued_tier("disk", disk, config.disk_timeout_s, config))
    if config.remote_url:
        redis = RedisBackend(
            config.remote_url,
            key_prefix=config.redis_key_prefix,
            ttl_s=config.redis_ttl_s,
            socket_timeout_s=redis_socket_timeout_s(config),
            max_connections=config.redis_max_connections,
        )
        tiers.append(_queued_tier("redis", redis, config.remote_timeout_s, config))
    shared = config.shared_dir_path()
    if shared is not None:
        fs = SharedDirBackend(
            shared,
            fsync=config.disk_fsync,
            mapped=config.mmap_reads,
            max_bytes=int(config.max_shared_dir_size * GB),
        )
        tiers.append(_queued_tier("fs", fs, config.remote_timeout_s, config))
    return tiers


def build_store(config: StoreConfig, metrics: StoreMetrics | None = None) -> TieredStore:
    """A TieredStore with the configured tiers and codec."""
    codec = ChunkCodec(config.resolved_codec(), config.hmac_key_bytes())
    return TieredStore(build_tiers(config), codec, metrics)
