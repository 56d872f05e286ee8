"""Storage backends: one async, batch-first interface (:class:`~kvmesh.store.backends.base.Backend`).

``memory`` (LRU in RAM), ``disk`` (bounded local directory), ``redis`` (Redis / Valkey / Redis
Cluster) and ``fs`` (a directory shared by many processes). Backends move opaque encoded chunks;
verification, timeouts, breakers and metrics are added around them by
:class:`~kvmesh.store.tiered.TieredStore`.
"""

from kvmesh.store.backends.base import Backend, BackendStats
from kvmesh.store.backends.disk import DiskBackend
from kvmesh.store.backends.fs import SharedDirBackend
from kvmesh.store.backends.memory import MemoryBackend
from kvmesh.store.backends.redis import RedisBackend

__all__ = [
    "Backend",
    "BackendStats",
    "DiskBackend",
    "MemoryBackend",
    "RedisBackend",
    "SharedDirBackend",
]
