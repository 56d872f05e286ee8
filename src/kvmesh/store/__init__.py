"""Pillar 1: the tiered KV store (CPU RAM, local disk, Redis/Valkey, shared directory).

Engines use :class:`KVCacheEngine` (token-level lookup / retrieve / store); tools and tests reach
the layers below it: :class:`TieredStore` (chunks across tiers), the backends, and
:class:`ChunkCodec` (the checksummed chunk format).
"""

from kvmesh.store.cache_engine import KVCacheEngine, RetrieveResult
from kvmesh.store.codec import ChunkCodec, Codec
from kvmesh.store.config import StoreConfig, load_config
from kvmesh.store.keys import StoreKey, namespace_group
from kvmesh.store.tiered import Tier, TieredStore

__all__ = [
    "ChunkCodec",
    "Codec",
    "KVCacheEngine",
    "RetrieveResult",
    "StoreConfig",
    "StoreKey",
    "Tier",
    "TieredStore",
    "load_config",
    "namespace_group",
]
