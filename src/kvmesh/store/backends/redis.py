"""Redis / Valkey tier over ``redis.asyncio``: pipelined batches, key prefix, optional TTL.

URLs: ``redis://``, ``rediss://`` (TLS), ``unix://``, ``valkey://`` and ``valkeys://`` (the same
protocol; rewritten to ``redis://`` / ``rediss://``). A Redis Cluster is selected with the scheme
``redis+cluster://`` (or ``valkey+cluster://``) or the query parameter ``cluster=true``; batches
then go through redis-py's cluster pipeline, which splits them by slot.

Keys are ``<prefix>:<group>:<chunk key hex>``, so ``flush`` of a group is a ``SCAN MATCH`` over one
pattern followed by ``UNLINK``. Pins live in a ledger beside the chunks
(:mod:`kvmesh.store.backends.redis_pins`, :attr:`RedisBackend.pins`). Client-side retries are disabled: a failed call fails fast and the
tiered store's breaker decides when to try again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvmesh.core.hashing import hex_key
from kvmesh.errors import TierUnavailableError
from kvmesh.store.backends.base import Backend, BackendStats, ChunkData
from kvmesh.store.backends.redis_pins import RedisPinLedger
from kvmesh.store.keys import StoreKey

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_SCHEMES = {
    "redis": ("redis", False),
    "rediss": ("rediss", False),
    "unix": ("unix", False),
    "valkey": ("redis", False),
    "valkeys": ("rediss", False),
    "redis+cluster": ("redis", True),
    "rediss+cluster": ("rediss", True),
    "valkey+cluster": ("redis", True),
    "valkeys+cluster": ("rediss", True),
}
_SCAN_COUNT = 1000
_UNLINK_BATCH = 512
MAX_PIPELINE_BYTES = 32 << 20
"""Most value bytes one ``SET`` pipeline carries. The socket timeout bounds each send as a whole, so
a write of a long prompt's chunks (30 float32 chunks of a small model are ~350 MiB) goes as several
pipelines, each well inside the timeout on a busy machine, rather than one that outlasts it."""


def byte_batches(calls: Sequence[_T], sizes: Sequence[int], limit: int) -> list[Sequence[_T]]:
    """``calls`` cut, in order, into runs whose ``sizes`` add up to at most ``limit`` (a call larger
    than ``limit`` runs alone)."""
    batches: list[Sequence[_T]] = []
    start = total = 0
    for i, size in enumerate(sizes):
        if i > start and total + size > limit:
            batches.append(calls[start:i])
            start, total = i, 0
        total += size
    if start < len(calls):
        batches.append(calls[start:])
    return batches


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs, errors and stats)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit((parts.scheme, f"{user}:***@{netloc}", parts.path, parts.query, parts.fragment))


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names a Redis-protocol server this backend can open."""
    return urlsplit(url).scheme.lower() in _SCHEMES


def normalize_url(url: str) -> tuple[str, bool]:
    """Rewrite a kvmesh Redis/Valkey URL for redis-py; returns (url, is_cluster).

    Raises:
        ValueError: not a Redis-protocol URL.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"not a Redis/Valkey URL: {url!r} (expected one of {sorted(_SCHEMES)})")
    real_scheme, cluster = _SCHEMES[scheme]
    query = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name == "cluster":
            cluster = value.lower() in {"1", "true", "yes"}
        else:
            query.append((name, value))
    return urlunsplit((real_scheme, parts.netloc, parts.path, urlencode(query), parts.fragment)), cluster


class RedisBackend:
    """Chunks as Redis string values.

    Args:
        url: server URL (see module docstring).
        key_prefix: first component of every key.
        ttl_s: expire chunks after this many seconds; ``None`` keeps them until evicted by the
            server's own ``maxmemory`` policy.
        socket_timeout_s: socket connect and read timeout (the tiered store adds its own, tighter,
            per-operation timeout on top).
        max_connections: connection pool size.
    """

    kind = "redis"

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "kvmesh",
        ttl_s: float | None = None,
        socket_timeout_s: float = 5.0,
        max_connections: int = 32,
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.url = redact_url(url)
        self.key_prefix = key_prefix
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        real_url, self.cluster = normalize_url(url)
        options: dict[str, Any] = {
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": socket_timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "max_connections": max_connections,
        }
        # redis-py's cluster pipeline does not queue UNLINK (it runs it as a separate coroutine).
        self._delete_cmd = "delete" if self.cluster else "unlink"
        self._client: Any
        if self.cluster:
            self._client = RedisCluster.from_url(real_url, **options)
        else:
            self._client = aioredis.Redis.from_url(real_url, **options)
        self.pins = RedisPinLedger(
            self._client,
            key_prefix,
            self._key,
            unpinned_ttl_ms=self.ttl_ms,
            cluster=self.cluster,
            url=self.url,
        )
        """Pins of this tier (refused on a cluster or under an ``allkeys-*`` eviction policy)."""

    def _key(self, key: StoreKey) -> str:
        return f"{self.key_prefix}:{key.group}:{hex_key(key.chunk)}"

    def _pattern(self, group: str | None) -> str:
        return f"{self.key_prefix}:{group or '*'}:*"

    def _fail(self, op: str, exc: BaseException) -> TierUnavailableError:
        return TierUnavailableError(f"redis tier {self.url}: {op} failed: {exc}")

    async def _pipeline(
        self, op: str, calls: Sequence[tuple[str, tuple[Any, ...], dict[str, Any]]]
    ) -> list[Any]:
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for name, args, kwargs in calls:
                    getattr(pipe, name)(*args, **kwargs)
                return list(await pipe.execute())
        except (RedisError, OSError) as exc:
            raise self._fail(op, exc) from exc

    async def exists_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        if not keys:
            return []
        replies = await self._pipeline("EXISTS", [("exists", (self._key(k),), {}) for k in keys])
        return [bool(r) for r in replies]

    async def get_many(self, keys: Sequence[StoreKey]) -> list[ChunkData | None]:
        if not keys:
            return []
        replies = await self._pipeline("GET", [("get", (self._key(k),), {}) for k in keys])
        return [r if isinstance(r, bytes) else None for r in replies]

    async def put_many(self, items: Sequence[tuple[StoreKey, ChunkData]]) -> int:
        if not items:
            return 0
        try:
            # Expired pins become evictable before this write adds memory pressure.
            await self.pins.maybe_release()
        except TierUnavailableError as exc:
            log.warning("%s", exc)
        extra = {} if self.ttl_ms is None else {"px": self.ttl_ms}
        # redis-py sends bytes and memoryviews as they are but refuses a bytearray (a recycled buffer)
        sets = [
            ("set", (self._key(k), memoryview(v) if isinstance(v, bytearray) else v), extra) for k, v in items
        ]
        stored = 0
        for batch in byte_batches(sets, [len(v) for _, v in items], MAX_PIPELINE_BYTES):
            stored += sum(1 for r in await self._pipeline("SET", batch) if r)
        return stored

    async def delete_many(self, keys: Sequence[StoreKey]) -> int:
        if not keys:
            return 0
        replies = await self._pipeline("UNLINK", [(self._delete_cmd, (self._key(k),), {}) for k in keys])
        return sum(int(r) for r in replies)

    async def flush(self, group: str | None = None) -> int:
        removed = 0
        batch: list[bytes] = []
        try:
            async for name in self._client.scan_iter(match=self._pattern(group), count=_SCAN_COUNT):
                batch.append(name)
                if len(batch) >= _UNLINK_BATCH:
                    removed += await self._unlink_names(batch)
                    batch = []
            if batch:
                removed += await self._unlink_names(batch)
        except (RedisError, OSError) as exc:
            raise self._fail("flush", exc) from exc
        return removed

    async def _unlink_names(self, names: list[bytes]) -> int:
        replies = await self._pipeline("UNLINK", [(self._delete_cmd, (n,), {}) for n in names])
        return sum(int(r) for r in replies)

    async def ping(self) -> bool:
        """Round trip to the server.

        Raises:
            TierUnavailableError: the server cannot be reached.
        """
        try:
            return bool(await self._client.ping())
        except (RedisError, OSError) as exc:
            raise self._fail("PING", exc) from exc

    async def stats(self) -> BackendStats:
        extra: dict[str, float | int | str] = {"url": self.url, "cluster": int(self.cluster)}
        if self.cluster:
            await self.ping()
            return BackendStats(kind=self.kind, num_chunks=-1, num_bytes=-1, extra=extra)
        try:
            info = await self._client.info("memory")
        except (RedisError, OSError) as exc:
            raise self._fail("INFO", exc) from exc
        extra["maxmemory_policy"] = str(info.get("maxmemory_policy", ""))
        return BackendStats(
            kind=self.kind,
            num_chunks=-1,
            num_bytes=int(info.get("used_memory", -1)),
            capacity_bytes=int(info.get("maxmemory", 0) or 0),
            extra=extra,
        )

    async def aclose(self) -> None:
        try:
            await self._client.aclose()
        except (RedisError, OSError):
            return


_check: type[Backend] = RedisBackend
