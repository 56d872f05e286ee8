"""kvmesh's store as a secondary tier of vLLM's native offloading (``TieringOffloadingSpec``).

vLLM copies KV between the GPU and its pinned CPU tier itself; this tier moves CPU-tier rows to and
from the kvmesh store (Redis/Valkey and/or a shared directory, with the store's checksums, HMAC,
breakers, timeouts and write budget), so every vLLM server of a pool shares one cache::

    scheduler thread                        store loop thread (one asyncio loop)
    lookup ── held? HIT : probe exists ───► exists_many ─┐
    submit_store(job) ──────────────────► encode rows ─► put + drain ─► JobResult, events
    submit_load(job)  ──────────────────► get_prefix ─► verify ─► copy into rows ─► JobResult
    get_finished_jobs ◄── finished queue ◄──────────────────────────────────┘

A user names it in ``secondary_tiers`` of the ``--kv-transfer-config``::

    {"type": "KVMeshSecondaryTier", "module_path": "kvmesh.integrations.vllm_tier",
     "remote_url": "redis://valkey:6379/0", "shared_dir": null, "hmac_key": null}

A corrupt, missing or slow chunk fails its job's keys (vLLM recomputes them); nothing here raises
into the engine. Stored chunks are announced through :meth:`take_events` with ``Locality.REMOTE``,
which the kvmesh router indexes as the fleet's shared tier.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvmesh.integrations.tier_keys import (
    RAW_ONLY,
    check_chunk_bytes,
    chunk_array,
    offload_store_key,
    tier_group,
)
from kvmesh.store.config import StoreConfig, load_config
from kvmesh.store.factory import build_store
from kvmesh.store.keys import StoreKey
from kvmesh.store.tiered import TieredStore

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

_HELD_KEYS = 1 << 20
"""Keys remembered as held (stored here or confirmed by a probe); older ones are probed again."""


COUNTERS: dict[str, str] = {
    "stores_ok": "Store jobs whose every chunk reached the kvmesh store.",
    "stores_failed": "Store jobs with a chunk the store did not take (dead tier, full queue, timeout).",
    "stores_refused": "Store jobs refused because max_inflight_jobs were running.",
    "loads_ok": "Load jobs that filled every chunk.",
    "loads_partial": "Load jobs that filled a leading part of their chunks.",
    "loads_failed": "Load jobs that filled no chunk (missing, corrupt, dead tier, timeout).",
    "bytes_written": "Encoded bytes of fully stored jobs.",
    "bytes_read": "Chunk bytes copied into vLLM's CPU tier.",
}
"""The tier's counters, exported to vLLM's metrics as ``vllm:kv_offload_kvmesh_<name>``."""


def _metric_name(counter: str) -> str:
    return f"vllm:kv_offload_kvmesh_{counter}"


def tier_store_config(store: str | None = None, **overrides: Any) -> StoreConfig:
    """The store the tier writes to: ``store``'s YAML and ``KVMESH_*`` variables, the tier's own
    fields over them, and no local tiers (vLLM's CPU tier is the RAM tier; a local disk would not
    be shared).

    Raises:
        ValueError: neither a Redis/Valkey URL nor a shared directory is configured.
    """
    config = load_config(store)
    fields = {name: value for name, value in overrides.items() if value is not None}
    config = msgspec.structs.replace(config, local_cpu=False, local_disk=None, codec=RAW_ONLY, **fields)
    if not config.remote_url and not config.shared_dir:
        raise ValueError("KVMeshSecondaryTier needs remote_url or shared_dir (inline or in its store YAML)")
    return config


def _model_name(spec: OffloadingSpec) -> str:
    vllm_config = getattr(spec, "vllm_config", None)
    model_config = getattr(vllm_config, "model_config", None)
    return str(getattr(model_config, "model", "") or "")


class KVMeshSecondaryTier(SecondaryTierManager):
    """A vLLM secondary tier over a :class:`~kvmesh.store.tiered.TieredStore`.

    Args (from the tier's entry in ``secondary_tiers``, besides vLLM's own):
        store: a kvmesh store YAML (``KVMESH_*`` variables override it, ``KVMESH_HMAC_KEY`` too);
            only its shared tiers are used: vLLM's CPU tier is the RAM tier. The fields below
            override it.
        remote_url: Redis/Valkey URL of the shared tier.
        shared_dir: a directory every server mounts.
        hmac_key: fleet key for chunk HMACs (``"hex:..."`` or text).
        model: names the store's flush group; defaults to vLLM's served model.
        job_timeout_s: a job still running after this fails all its keys.
        max_inflight_jobs: stores beyond this many running jobs are refused (loads never are).
        remote_timeout_s: limit of one call to Redis/Valkey.
        max_shared_dir_size: shared directory budget in GB (0: none).
        write_queue_mb: bytes the store may queue per tier before dropping writes.
    """

    medium: ClassVar[Medium | None] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        store: str | None = None,
        remote_url: str | None = None,
        shared_dir: str | None = None,
        hmac_key: str | None = None,
        model: str | None = None,
        job_timeout_s: float = 10.0,
        max_inflight_jobs: int = 64,
        remote_timeout_s: float | None = None,
        max_shared_dir_size: float | None = None,
        write_queue_mb: float | None = None,
        locality: str | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._config = tier_store_config(
            store,
            remote_url=remote_url,
            shared_dir=shared_dir,
            hmac_key=hmac_key,
            remote_timeout_s=remote_timeout_s,
            max_shared_dir_size=max_shared_dir_size,
            write_queue_mb=write_queue_mb,
        )
        check_chunk_bytes(self.block_size_bytes)
        self.locality = Locality(locality) if locality else Locality.REMOTE
        self.job_timeout_s = job_timeout_s
        self.max_inflight_jobs = max_inflight_jobs
        # numpy indexes rows of the 2-D view (a memoryview cannot), without copying.
        self._rows = np.asarray(primary_kv_view).view(np.uint8).reshape(len(primary_kv_view), -1)
        self._group = tier_group(model or _model_name(offloading_spec))
        self._lock = threading.Lock()
        self._finished: list[JobResult] = []
        self._events: list[OffloadingEvent] = []
        self._running: dict[int, Future[JobResult]] = {}
        self._held: OrderedDict[OffloadKey, None] = OrderedDict()
        self._probes: dict[OffloadKey, Future[bool]] = {}
        self._misses: dict[str, set[OffloadKey]] = {}
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._unreported: dict[str, int] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvmesh-vllm-tier", daemon=True)
        self._thread.start()
        self._store: TieredStore = self._run(self._build()).result()

    async def _build(self) -> TieredStore:
        store = build_store(self._config)
        store.expect_chunk_bytes(self.block_size_bytes)
        return store

    def _run(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _key(self, key: OffloadKey) -> StoreKey:
        return offload_store_key(self._group, key, self.block_size_bytes)

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount
            self._unreported[name] = self._unreported.get(name, 0) + amount

    def _remember(self, keys: Iterable[OffloadKey]) -> None:
        with self._lock:
            for key in keys:
                self._held[key] = None
                self._held.move_to_end(key)
            while len(self._held) > _HELD_KEYS:
                self._held.popitem(last=False)

    def _forget(self, keys: Iterable[OffloadKey]) -> None:
        with self._lock:
            for key in keys:
                self._held.pop(key, None)

    # ----------------------------------------------------------------- lookups

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT for a key known held; otherwise probe the store (RETRY until it answers)."""
        with self._lock:
            if key in self._held:
                self._held.move_to_end(key)
                return LookupResult.HIT
        probe = self._probes.get(key)
        if probe is None:
            if key in self._misses.get(req_context.req_id, ()):
                return LookupResult.MISS
            self._probes[key] = self._run(self._exists(key))
            return LookupResult.RETRY
        if not probe.done():
            return LookupResult.RETRY
        del self._probes[key]
        if probe.exception() is None and probe.result():
            self._remember([key])
            return LookupResult.HIT
        self._misses.setdefault(req_context.req_id, set()).add(key)
        return LookupResult.MISS

    async def _exists(self, key: OffloadKey) -> bool:
        return await self._store.count_prefix([self._key(key)]) == 1

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Keep recently used keys longest in the held set."""
        with self._lock:
            for key in keys:
                if key in self._held:
                    self._held.move_to_end(key)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._misses.pop(req_context.req_id, None)

    # ----------------------------------------------------------------- jobs

    def submit_store(self, job_metadata: TransferJob) -> None:
        with self._lock:
            refused = len(self._running) >= self.max_inflight_jobs
        if refused:
            self._count("stores_refused", 1)
            self._finish(JobResult(job_metadata.job_id, success=False))
            return
        self._start(job_metadata.job_id, self._store_job(job_metadata))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._start(job_metadata.job_id, self._load_job(job_metadata))

    def _start(self, job_id: int, coro: Any) -> None:
        future: Future[JobResult] = self._run(self._bounded(job_id, coro))
        with self._lock:
            self._running[job_id] = future
        future.add_done_callback(lambda done: self._finish(done.result(), job_id))

    async def _bounded(self, job_id: int, coro: Any) -> JobResult:
        try:
            result: JobResult = await asyncio.wait_for(coro, self.job_timeout_s)
            return result
        except TimeoutError:
            log.warning(
                "kvmesh tier: job %d timed out after %.1f s; its keys fail", job_id, self.job_timeout_s
            )
        except Exception:
            log.exception("kvmesh tier: job %d failed; its keys fail", job_id)
        return JobResult(job_id, success=False)

    def _finish(self, result: JobResult, job_id: int | None = None) -> None:
        with self._lock:
            if job_id is not None:
                self._running.pop(job_id, None)
            self._finished.append(result)

    async def _store_job(self, job: TransferJob) -> JobResult:
        start = time.perf_counter()
        keys = list(job.keys)
        store_keys = [self._key(k) for k in keys]
        codec = self._store.codec
        items = [
            (sk, codec.encode(sk, chunk_array(self._rows[int(c)])))
            for sk, c in zip(store_keys, job.chunk_ids, strict=True)
        ]
        landed: set[StoreKey] = set()

        def written(tier: str, held: list[StoreKey]) -> None:
            landed.update(held)

        await self._store.put(items, on_written=written)
        await self._store.drain()
        ok = [k for k, sk in zip(keys, store_keys, strict=True) if sk in landed]
        num_bytes = sum(len(v) for _, v in items)
        if ok:
            self._remember(ok)
            with self._lock:
                self._events.append(
                    OffloadingEvent(ok, Medium.STORAGE, removed=False, locality=self.locality)
                )
        success = len(ok) == len(keys)
        self._count("stores_ok" if success else "stores_failed")
        self._count("bytes_written", num_bytes if success else 0)
        return JobResult(
            job.job_id, success, transfer_time=time.perf_counter() - start, transfer_bytes=num_bytes
        )

    async def _load_job(self, job: TransferJob) -> JobResult:
        start = time.perf_counter()
        keys = list(job.keys)
        found = await self._store.get_prefix([self._key(k) for k in keys])
        loaded: list[OffloadKey] = []
        num_bytes = 0
        for key, chunk_id, item in zip(keys, job.chunk_ids, found.chunks, strict=False):
            row = self._rows[int(chunk_id)]
            payload = np.ascontiguousarray(item.chunk.kv).view(np.uint8).reshape(-1)
            if payload.size != row.size:
                log.warning("kvmesh tier: chunk of %d bytes where %d were expected", payload.size, row.size)
                break
            row[:] = payload
            loaded.append(key)
            num_bytes += payload.size
        self._forget(keys[len(loaded) :])
        self._count("bytes_read", num_bytes)
        elapsed = time.perf_counter() - start
        if len(loaded) == len(keys):
            self._count("loads_ok", 1)
            return JobResult(job.job_id, True, transfer_time=elapsed, transfer_bytes=num_bytes)
        self._count("loads_partial" if loaded else "loads_failed")
        return JobResult(
            job.job_id, False, successful_keys=loaded, transfer_time=elapsed, transfer_bytes=num_bytes
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def has_pending_work(self) -> bool:
        """Jobs to report, or probes a waiting request's next lookup needs answered."""
        with self._lock:
            if self._running or self._finished:
                return True
        return any(not probe.done() for probe in self._probes.values())

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Chunks this tier stored since the last call, announced as remote storage."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def drain_jobs(self) -> None:
        """Wait for every submitted job; a job ends by itself within ``job_timeout_s``."""
        with self._lock:
            running = list(self._running.values())
        for future in running:
            future.exception()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {_metric_name(name): OffloadingCounterMetadata(doc) for name, doc in COUNTERS.items()}

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Counter increases since the last call, for vLLM's Prometheus metrics."""
        with self._lock:
            unreported, self._unreported = self._unreported, {}
        if not unreported:
            return None
        stats = OffloadingConnectorStats()
        for name, amount in unreported.items():
            stats.increase_counter(_metric_name(name), amount)
        return stats

    def stats(self) -> dict[str, Any]:
        """Job counters and the store's per-tier statistics."""
        store_stats = self._run(self._store.stats()).result(timeout=self.job_timeout_s)
        return {"jobs": dict(self.counters), "store": store_stats}

    def shutdown(self) -> None:
        """Finish running jobs, close the store and stop its loop thread."""
        if not self._thread.is_alive():
            return
        self.drain_jobs()
        self._run(self._store.aclose()).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        # The primary tier releases its memoryview after this; no array may still export it.
        self._rows = np.empty((0, 0), np.uint8)
