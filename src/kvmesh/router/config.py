"""The router's configuration file (``kvmesh router --config router.yaml``).

::

    host: 127.0.0.1
    port: 8080
    model: null            # namespace model name; null takes the first endpoint's /kvmesh/info
    revision: null         # model revision in block keys; null likewise
    tokenizer: smollm2     # tokenizer spec (kvmesh.core.models); null routes text prompts by load only
    blockSize: 16
    hashAlgo: xxh3
    adminToken: null       # bearer token of /admin/*; null reads $KVMESH_ROUTER_ADMIN_TOKEN, else admin is off
    policy: precise        # a preset name, used when no `scheduler` is given
    scheduler: {plugins: [...], schedulingProfiles: [...]}
    index: {backend: memory, capacity: 2000000, redisUrl: null, keyPrefix: "kvmesh:idx:"}
    health: {intervalS: 0.5, timeoutS: 0.5, failureThreshold: 2, metricsIntervalS: 1.0}
    upstream: {maxConnectionsPerEndpoint: 1024, keepaliveS: 15.0}
    flowControl: {enabled: true, maxPredictedTtftSeconds: 10, maxQueueWaitSeconds: 15,
                  maxQueuedRequests: 10000, perTenantMaxQueued: 0}   # see kvmesh.router.flow_control
    cacheReport: {maxTenants: 256, explainHistory: 1024, seenBlocks: 262144, textPrefixes: 65536}
    endpoints:
      - {url: "http://127.0.0.1:8001"}
      - {url: "http://10.0.0.7:8000", role: decode, eventsEndpoint: "tcp://10.0.0.7:5557"}
    pools: []              # several models behind one gateway: kvmesh.router.pool_config

Keys are camelCase as in llm-d's configs; unknown keys are rejected.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import yaml

from kvmesh.core.hashing import DEFAULT_BLOCK_SIZE, HashAlgo
from kvmesh.errors import ConfigError
from kvmesh.router.cache_explain import CacheReportConfig
from kvmesh.router.discovery import DnsDiscoveryConfig
from kvmesh.router.endpoints import EndpointConfig
from kvmesh.router.flow_control import FlowControlConfig
from kvmesh.router.pool_config import PoolConfig, check_pools

ADMIN_TOKEN_ENV = "KVMESH_ROUTER_ADMIN_TOKEN"


class IndexConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """Where the block index lives."""

    backend: str = "memory"
    """``memory`` (default) or ``redis`` (shared by several router replicas)."""
    capacity: int = 2_000_000
    """Most keys the in-memory index keeps (LRU)."""
    redis_url: str | None = None
    key_prefix: str = "kvmesh:idx:"
    ttl_s: float | None = None
    """Redis only: entries expire this long after their last write."""
    redis_max_connections: int = 32
    """Redis only: connections to the server (the write-behind thread and the lookups' worker
    threads share them; a caller that finds all busy waits up to 2 s for one)."""
    max_blocks_per_pod: int = 1_000_000
    key_memo_capacity: int = 262_144
    """Block keys remembered from event tokens so matching skips re-hashing them (0: off); kept
    with ``hashAlgo: sha256`` only (an xxh3 digest costs what a probe does)."""


class HealthConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """Health-check and metrics-scrape timing."""

    interval_s: float = 0.5
    timeout_s: float = 0.5
    failure_threshold: int = 2
    metrics_interval_s: float = 1.0


class UpstreamConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """The router's HTTP connections to its endpoints for requests (health checks and scrapes
    have their own, :data:`kvmesh.router.endpoints.PROBE_CONNECTIONS_PER_ENDPOINT` per endpoint)."""

    max_connections_per_endpoint: int = 1024
    """Connections open to one endpoint, busy or idle (P/D prefill legs included). A request that
    finds them all busy waits in the router until one frees (it counts as in flight there). The
    pool hands out its idle connections oldest first, so under steady traffic none stays idle for
    ``keepaliveS`` and the pool keeps as many connections as were ever busy at once: this is the
    bound on that. 1024 is vLLM's default batch (``max_num_seqs``) on an 80 GB GPU, so by default
    the router never holds back a request an engine could start; lower it to the engines' batch
    plus a queue's worth when they batch fewer (the router then holds at most this many sockets per
    endpoint, and each engine as many from the router)."""
    keepalive_s: float = 15.0
    """An idle connection is closed after this many seconds (once traffic drops)."""


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """Everything ``kvmesh router`` needs."""

    host: str = "127.0.0.1"
    port: int = 8080
    model: str | None = None
    revision: str | None = None
    tokenizer: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    hash_algo: str = HashAlgo.XXH3.value
    """Digest of the router's own block keys. Engines' hashes are opaque to the router (it
    re-hashes event tokens), so this need not match them; xxh3 makes ingestion and scoring
    cheaper. Tenants stay apart because the tenant is in every chain's root; a collision can only
    misroute a request, never serve another tenant's KV (engines and the store key with their own
    digest). Routers sharing a Redis index must agree on it."""
    admin_token: str | None = None
    policy: str = "precise"
    scheduler: dict[str, Any] | None = None
    index: IndexConfig = msgspec.field(default_factory=IndexConfig)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    upstream: UpstreamConfig = msgspec.field(default_factory=UpstreamConfig)
    flow_control: FlowControlConfig = msgspec.field(default_factory=FlowControlConfig)
    """Requests wait in the router while every endpoint is saturated (fair across tenants, by
    priority) and are answered 429 past a deadline; see :mod:`kvmesh.router.flow_control`."""
    cache_report: CacheReportConfig = msgspec.field(default_factory=CacheReportConfig)
    """Bounds of the ``x-kvmesh-cache`` explanations, ``/admin/explain`` and ``/admin/usage``;
    see :mod:`kvmesh.router.cache_report`."""
    endpoints: list[EndpointConfig] = msgspec.field(default_factory=list)
    discovery: list[DnsDiscoveryConfig] = msgspec.field(default_factory=list)
    """DNS names (Kubernetes headless Services) whose addresses are engine pods, followed at run
    time; see :mod:`kvmesh.router.discovery`."""
    events_topic: str = ""
    max_attempts: int = 3
    """Endpoints tried per request when connecting fails."""
    request_timeout_s: float = 600.0
    max_body_bytes: int = 64 * 1024 * 1024
    """Larger request bodies are answered 413."""
    max_pin_ttl_s: float = 86400.0
    """The longest pin (``{"kvmesh": {"cache_ttl_s": N}}``, header ``x-kvmesh-cache-ttl-s``) a
    request may ask for; longer is a 400. Engines check it against their own store's limit too."""
    tokenize_thread_min_chars: int = 8192
    """Text prompts with this many characters or more left to tokenize (after the exact cache and
    the learnt prefixes) are tokenized on a worker thread (the tokenizer releases the GIL, so the
    event loop keeps serving); the rest inline, where the hop would cost more than it saves."""
    tokenizer_cache_entries: int = 4096
    """Exact prompts (and exact chat message lists) whose token ids are kept, least recently used
    leaving first; 0 disables the cache. See :mod:`kvmesh.router.tokenize`."""
    tokenizer_prefix_reuse: bool = True
    """Reuse the token ids of a long leading part shared with earlier prompts (a system prompt),
    only for tokenizers where that provably equals a full tokenization (byte-level BPE); each
    learnt prefix is also checked once against a full tokenization. See
    :mod:`kvmesh.router.prefix_tokens`."""
    seed: int | None = None
    """Seeds the scheduler's random source (ties, random policies)."""
    pools: list[PoolConfig] = msgspec.field(default_factory=list)
    """Several served models behind this gateway, one pool each (see
    :mod:`kvmesh.router.pool_config`); empty: the top-level keys are the one pool."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"blockSize must be positive, got {self.block_size}")
        try:
            HashAlgo(self.hash_algo)
        except ValueError as exc:
            raise ConfigError(f"hashAlgo must be sha256 or xxh3, got {self.hash_algo!r}") from exc
        if self.index.backend not in ("memory", "redis"):
            raise ConfigError(f"index.backend must be memory or redis, got {self.index.backend!r}")
        if self.index.backend == "redis" and not self.index.redis_url:
            raise ConfigError("index.backend redis needs index.redisUrl")
        if self.index.redis_max_connections < 1:
            raise ConfigError(
                f"index.redisMaxConnections must be >= 1, got {self.index.redis_max_connections}"
            )
        if self.tokenizer_cache_entries < 0:
            raise ConfigError(f"tokenizerCacheEntries must be >= 0, got {self.tokenizer_cache_entries}")
        if self.upstream.max_connections_per_endpoint < 1:
            raise ConfigError(
                "upstream.maxConnectionsPerEndpoint must be >= 1, got "
                f"{self.upstream.max_connections_per_endpoint}"
            )
        if self.upstream.keepalive_s <= 0:
            raise ConfigError(f"upstream.keepaliveS must be > 0, got {self.upstream.keepalive_s}")
        if self.max_pin_ttl_s <= 0:
            raise ConfigError(f"maxPinTtlS must be > 0, got {self.max_pin_ttl_s}")
        if self.max_attempts < 1:
            raise ConfigError(f"maxAttempts must be >= 1, got {self.max_attempts}")
        if self.admin_token is None:
            self.admin_token = os.environ.get(ADMIN_TOKEN_ENV) or None
        check_pools(self.pools, has_top_level_endpoints=bool(self.endpoints or self.discovery))


def router_config_from_dict(raw: Any) -> RouterConfig:
    """Validate a parsed YAML mapping.

    Raises:
        ConfigError: wrong types, unknown keys or invalid values.
    """
    try:
        return msgspec.convert(raw, type=RouterConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"router config: {exc}") from exc


def load_router_config(path: str | Path) -> RouterConfig:
    """Read and validate a router YAML file.

    Raises:
        ConfigError: unreadable file, invalid YAML or invalid config.
    """
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read router config {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    return router_config_from_dict(raw or {})
