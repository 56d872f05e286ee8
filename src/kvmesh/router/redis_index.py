"""A :class:`~kvmesh.router.index.BlockIndex` in Redis/Valkey, shared by several router replicas.

Layout (``P`` is the key prefix, ``k`` the 16 raw key bytes)::

    P b: k        hash   field "<pod>|<tier bit>" → 1      one field per (pod, tier)
    P p: <pod>    set    of k                             the pod's keys, for clear_pod
    P pods        set    of pod ids

Every write is idempotent (HSET/HDEL/SADD), so replicas that all subscribe to the same event
streams converge on the same contents. Memory is bounded by the server (``maxmemory`` with an
LRU policy) and optionally by a TTL refreshed on each write. Calls are synchronous and pipelined:
one round trip per ``add``/``remove``, one per 32 blocks of a ``lookup``, and two per
:meth:`RedisIndex.write_batch` run of adds and removes. The gateway does not call it from its event
loop: :class:`~kvmesh.router.write_behind.WriteBehindIndex` batches the writes on a thread and
lookups run on worker threads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import islice, repeat

import redis

from kvmesh.core.types import BlockKey, PodId
from kvmesh.errors import TierUnavailableError
from kvmesh.router.index import ALL_MEDIA, MEDIUM_BITS, BlockIndex, Holders, IndexStats, MediumSet
from kvmesh.router.write_behind import AddBlocks, BatchWritable, ClearPod, IndexWrite, RemoveBlocks

_BITS = tuple(MEDIUM_BITS.values())
_LOOKUP_GROUP = 32
_SOCKET_TIMEOUT_S = 2.0


class RedisIndex:
    """Block index stored in Redis.

    Args:
        url: ``redis://host:port/db`` (Valkey speaks the same protocol).
        key_prefix: namespace of this index's keys.
        ttl_s: expire entries this long after their last write (``None``: never).
        client: an existing client (the URL and ``max_connections`` are then ignored).
        max_connections: connections to the server, shared by the threads that call the index
            (the write-behind thread, lookups on worker threads); a thread that finds them all
            busy waits for one up to the socket timeout, then gets :class:`TierUnavailableError`.

    Raises:
        TierUnavailableError: from any method when the server cannot be reached.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        key_prefix: str = "kvmesh:idx:",
        ttl_s: float | None = None,
        client: redis.Redis | None = None,
        max_connections: int = 32,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self._own_pool: redis.BlockingConnectionPool | None = None
        if client is None:
            # redis-py's default pool opens a connection per concurrent caller without limit.
            self._own_pool = redis.BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=_SOCKET_TIMEOUT_S,
                socket_timeout=_SOCKET_TIMEOUT_S,
            )
            client = redis.Redis(connection_pool=self._own_pool)
        self.client = client
        self.prefix = key_prefix.encode()
        self.ttl_ms = None if ttl_s is None else int(ttl_s * 1000)
        self._block_prefix = self.prefix + b"b:"
        self._pods_key = self.prefix + b"pods"

    def _pod_key(self, pod: PodId) -> bytes:
        return self.prefix + b"p:" + pod.encode()

    def add(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet) -> None:
        if keys:
            self.write_batch([AddBlocks(tuple(keys), pod, media)])

    def remove(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet = ALL_MEDIA) -> None:
        if keys:
            self.write_batch([RemoveBlocks(tuple(keys), pod, media)])

    def write_batch(self, writes: Sequence[IndexWrite]) -> None:
        """Apply ``writes`` in order: each run of adds and removes in one pipeline.

        Raises:
            TierUnavailableError: the server cannot be reached.
        """
        try:
            run: list[AddBlocks | RemoveBlocks] = []
            for write in writes:
                if isinstance(write, ClearPod):
                    self._write_run(run)
                    run = []
                    self._clear_pod(write.pod)
                else:
                    run.append(write)
            self._write_run(run)
        except redis.RedisError as exc:
            raise TierUnavailableError(f"redis index write failed: {exc}") from exc

    def _write_run(self, run: Sequence[AddBlocks | RemoveBlocks]) -> None:
        if not run:
            return
        bp = self._block_prefix
        pipe = self.client.pipeline(transaction=False)
        removed: list[tuple[PodId, BlockKey]] = []
        for write in run:
            pod, keys = write.pod, write.keys
            if isinstance(write, AddBlocks):
                fields = {f"{pod}|{bit}": 1 for bit in _BITS if write.media & bit}
                for key in keys:
                    name = bp + key
                    pipe.hset(name, mapping=fields)  # type: ignore[arg-type]
                    if self.ttl_ms is not None:
                        pipe.pexpire(name, self.ttl_ms)
                pipe.sadd(self._pod_key(pod), *keys)
                pipe.sadd(self._pods_key, pod)
            else:
                dropped = [f"{pod}|{bit}" for bit in _BITS if write.media & bit]
                for key in keys:
                    pipe.hdel(bp + key, *dropped)
                removed.extend(zip(repeat(pod), keys))
        pipe.execute()
        if not removed:
            return
        # Keys a pod no longer holds in any tier (after the whole run) leave its membership set.
        check = self.client.pipeline(transaction=False)
        for pod, key in removed:
            check.hmget(bp + key, [f"{pod}|{bit}" for bit in _BITS])
        gone: dict[PodId, list[BlockKey]] = {}
        for (pod, key), vals in zip(removed, check.execute(), strict=True):
            if not any(vals):
                gone.setdefault(pod, []).append(key)
        if gone:
            srem = self.client.pipeline(transaction=False)
            for pod, pod_keys in gone.items():
                srem.srem(self._pod_key(pod), *pod_keys)
            srem.execute()

    def lookup(self, keys: Iterable[BlockKey]) -> list[Holders]:
        out: list[Holders] = []
        it: Iterator[BlockKey] = iter(keys)
        bp = self._block_prefix
        try:
            while True:
                group = list(islice(it, _LOOKUP_GROUP))
                if not group:
                    return out
                pipe = self.client.pipeline(transaction=False)
                for key in group:
                    pipe.hgetall(bp + key)
                for raw in pipe.execute():
                    if not raw:
                        return out
                    holders: dict[PodId, MediumSet] = {}
                    for field in raw:
                        pod_s, _, bit_s = field.decode().rpartition("|")
                        pod = PodId(pod_s)
                        holders[pod] = MediumSet(holders.get(pod, 0) | int(bit_s))
                    out.append(holders)
        except redis.RedisError as exc:
            raise TierUnavailableError(f"redis index lookup failed: {exc}") from exc

    def clear_pod(self, pod: PodId) -> int:
        try:
            return self._clear_pod(pod)
        except redis.RedisError as exc:
            raise TierUnavailableError(f"redis index clear_pod failed: {exc}") from exc

    def _clear_pod(self, pod: PodId) -> int:
        pod_key = self._pod_key(pod)
        fields = [f"{pod}|{bit}" for bit in _BITS]
        bp = self._block_prefix
        dropped = 0
        batch: list[bytes] = []
        for key in self.client.sscan_iter(pod_key, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                dropped += self._hdel_many(batch, fields, bp)
                batch = []
        if batch:
            dropped += self._hdel_many(batch, fields, bp)
        self.client.delete(pod_key)
        self.client.srem(self._pods_key, pod)
        return dropped

    def _hdel_many(self, keys: list[bytes], fields: list[str], bp: bytes) -> int:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hdel(bp + key, *fields)
        return sum(1 for n in pipe.execute() if n)

    def stats(self) -> IndexStats:
        try:
            pods = self.client.smembers(self._pods_key)
            pipe = self.client.pipeline(transaction=False)
            for pod in pods:
                pipe.scard(self.prefix + b"p:" + (pod if isinstance(pod, bytes) else pod.encode()))
            entries = sum(int(n) for n in pipe.execute()) if pods else 0
            num_keys = sum(1 for _ in self.client.scan_iter(match=self._block_prefix + b"*", count=1000))
        except redis.RedisError as exc:
            raise TierUnavailableError(f"redis index stats failed: {exc}") from exc
        return IndexStats(num_keys, entries, 0, -1, "redis")

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()
        if self._own_pool is not None:
            self._own_pool.disconnect()


def _conforms(index: RedisIndex) -> tuple[BlockIndex, BatchWritable]:
    return index, index
