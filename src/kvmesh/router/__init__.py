"""Pillar 2: the KV-cache-aware router and OpenAI-compatible gateway.

Pieces, each usable alone (the fleet simulator drives the index and scheduler in virtual time)::

    events ─► intake (ZMQ subscriber) ─► ingest (re-hash tokens) ─► index (block → pods × tiers)
    request ─► gateway (request_parser: validate, tenant, u32 ids) ─► scheduler (match, filters →
               scorers → picker) ─► [prefill_leg] ─► proxy ─► endpoint
"""

from kvmesh.router.discovery import DnsDiscovery, DnsDiscoveryConfig
from kvmesh.router.endpoints import EndpointConfig, EndpointPool
from kvmesh.router.gateway import Gateway
from kvmesh.router.index import BlockIndex, IndexStats, InMemoryIndex, InstrumentedIndex, MediumSet
from kvmesh.router.ingest import EventApplier, IngestStats
from kvmesh.router.intake import EventIntake
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.pool_config import PoolConfig
from kvmesh.router.pools import PooledRouter
from kvmesh.router.prefix import match_prefix
from kvmesh.router.redis_index import RedisIndex
from kvmesh.router.scheduler import Scheduler, load_scheduler_config
from kvmesh.router.types import Decision, EndpointState, PodMatch, PrefixMatch, Role, RoutingRequest
from kvmesh.router.usage import UsageLedger
from kvmesh.router.write_behind import WriteBehindIndex

__all__ = [
    "BlockIndex",
    "BlockKeyMemo",
    "Decision",
    "DnsDiscovery",
    "DnsDiscoveryConfig",
    "EndpointConfig",
    "EndpointPool",
    "EndpointState",
    "EventApplier",
    "EventIntake",
    "Gateway",
    "InMemoryIndex",
    "IndexStats",
    "IngestStats",
    "InstrumentedIndex",
    "MediumSet",
    "PodMatch",
    "PoolConfig",
    "PooledRouter",
    "PrefixMatch",
    "RedisIndex",
    "Role",
    "RoutingRequest",
    "Scheduler",
    "UsageLedger",
    "WriteBehindIndex",
    "load_scheduler_config",
    "match_prefix",
]
