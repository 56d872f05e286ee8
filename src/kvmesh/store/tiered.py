# Over 450 lines: the tier walk, promotion and write-back share the tier list, the breakers and the in-flight writes; split, each part would reach into the others.
"""TieredStore: ordered tiers behind one prefix-oriented API that never raises for a bad tier.

::

    fastest ─────────────────────────────────────────────► slowest
    cpu (memory)        disk            redis / valkey / fs
    written inline      ─── written by one worker task per tier, fed by a bounded queue ───

Reads (``count_prefix`` / ``get_prefix``) take the keys of consecutive chunks of one prompt. A
chunk is available when any tier holds it; the first chunk no tier holds ends the prefix (a gap
truncates the hit, later chunks are useless without it). Chunks are fetched from the fastest tier
that holds them, verified by the codec (a corrupt chunk is deleted, counted and looked for in the
next tier) and copied into the faster tiers (promotion). Concurrent reads of one chunk share one
fetch (single-flight).

Every tier call goes through the tier's circuit breaker and per-tier timeout. A timeout, a
:class:`~kvmesh.errors.TierUnavailableError` or an open breaker turns into a miss (reads) or a
dropped write, counted in the tier's :class:`~kvmesh.store.metrics.TierCounters`; it never
reaches the caller. Writes to queued tiers never wait for the tier: a full queue drops the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeAlias, TypeVar

from kvmesh.core.tasks import cancel_and_wait
from kvmesh.core.tier_scan import PrefixScan
from kvmesh.errors import CorruptChunkError, TierUnavailableError
from kvmesh.store.backends.base import Backend, ChunkData
from kvmesh.store.breaker import CircuitBreaker
from kvmesh.store.codec import ChunkCodec, DecodedChunk
from kvmesh.store.keys import StoreKey
from kvmesh.store.metrics import StoreMetrics, TierCounters, TierSnapshot
from kvmesh.store.pins import PinOutcome, PinRequest, pin_ledger

log = logging.getLogger(__name__)
T = TypeVar("T")
_DECODE_IN_THREAD_BYTES = 1 << 20
VERIFY_THREADS = 4
"""Threads that verify one long read (about 1 MiB of chunks each at least)."""
_CLOSE_DRAIN_S = 5.0


TierWritten: TypeAlias = Callable[[str, list[StoreKey]], None]
"""``(tier name, keys)``: after one :meth:`TieredStore.put` reached a tier, the keys of that put
the tier now holds (written now or held already). Called on the event loop; must not raise."""

TRANSFER_SECONDS_PER_MIB = 0.05
"""Extra timeout per MiB written (a 20 MiB/s floor): float32 chunks of small models are ~12 MiB
each, an 8B model's bfloat16 chunk 32 MiB, and a batch of them on a busy machine outlasts a fixed
one-second limit while the tier is healthy. Writes run in the background, so a longer limit never
stalls an engine."""
READ_SECONDS_PER_MIB = 0.01
"""Extra timeout per MiB of a read (a 100 MiB/s floor), for the keys asked for times the largest
verified chunk seen (:attr:`TieredStore.chunk_bytes`): a 2 GiB prefix is not mistaken for a dead
tier. A request waits on its read, so the extra is capped at :data:`MAX_READ_EXTRA_S`."""
MAX_READ_EXTRA_S = 4.0
"""Longest a read may outlast the tier's timeout; past it the prefix is recomputed."""


@dataclass(slots=True)
class Tier:
    """One tier and how the store treats it.

    Args:
        name: label in results and metrics ("cpu", "disk", "redis", "fs").
        backend: the storage.
        timeout_s: limit of one call to the backend; ``None`` for no limit (memory).
        breaker: the tier's circuit breaker.
        queued: writes go through a bounded queue and a worker task instead of inline.
        max_queue_bytes: bytes of encoded chunks the queue may hold; beyond, writes are dropped
            (a single write larger than this is taken when nothing else is queued).
        promote: copy chunks found in slower tiers into this one.
    """

    name: str
    backend: Backend
    timeout_s: float | None = None
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    queued: bool = False
    max_queue_bytes: int = 256 << 20
    promote: bool = True
    counters: TierCounters = field(default_factory=TierCounters)
    queue_bytes: int = 0
    _queue: asyncio.Queue[_WriteOp | None] | None = field(default=None, init=False, repr=False)
    _worker: asyncio.Task[None] | None = field(default=None, init=False, repr=False)


@dataclass(slots=True)
class _WriteOp:
    kind: str
    """"put" (skip keys the tier already holds), "promote" (put as is), "delete" or "pin"."""
    items: list[tuple[StoreKey, ChunkData]] = field(default_factory=list)
    keys: list[StoreKey] = field(default_factory=list)
    on_written: TierWritten | None = None
    """For "put": told which keys the tier holds once the write succeeded."""
    vouch: list[StoreKey] = field(default_factory=list)
    """For "put" with ``on_written``: keys not written whose presence the report should confirm
    (checked in the same ``exists`` call; only those present are reported)."""
    pin: Callable[[], Awaitable[PinOutcome]] | None = None
    """For "pin": the ledger call, run after the writes queued before it."""
    done: asyncio.Future[PinOutcome | None] | None = None
    """For "pin": its outcome (``None``: dropped, or the tier failed)."""

    def resolve(self, outcome: PinOutcome | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(outcome)

    @property
    def num_bytes(self) -> int:
        return sum(len(v) for _, v in self.items)


@dataclass(slots=True)
class FoundChunk:
    """A verified chunk and the tier that served it."""

    chunk: DecodedChunk
    tier: str
    data: ChunkData


@dataclass(slots=True)
class PrefixResult:
    """The longest run of leading chunks the tiers could serve."""

    chunks: list[FoundChunk]
    num_held: int = -1
    """Leading chunks the tiers said they held (fewer served: a chunk failed its checks or its
    tier failed in between); ``-1``: the number of chunks served."""

    def __post_init__(self) -> None:
        if self.num_held < 0:
            self.num_held = len(self.chunks)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)


class TieredStore:
    """Ordered tiers (fastest first) with prefix reads, write-through and promotion.

    Args:
        tiers: fastest first; names must be unique.
        codec: verifies (and, for the caller, encodes) chunks.
        metrics: where latencies go and whose collector reads the counters.
    """

    def __init__(self, tiers: Sequence[Tier], codec: ChunkCodec, metrics: StoreMetrics | None = None) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers = list(tiers)
        self.codec = codec
        self.metrics = metrics if metrics is not None else StoreMetrics()
        self.chunk_bytes = 0
        """Largest encoded chunk written or read so far (or announced by :meth:`expect_chunk_bytes`)."""
        self.num_lookup_chunks = 0
        self.num_lookup_hit_chunks = 0
        self._inflight: dict[StoreKey, asyncio.Future[FoundChunk | None]] = {}
        self._closed = False
        self.metrics.attach(self.snapshots, self._lookup_totals)

    def expect_chunk_bytes(self, num_bytes: int) -> None:
        """Announce the size of the chunks this store will carry, so the first read of a process
        that has written nothing yet gets its transfer allowance (see :data:`TRANSFER_SECONDS_PER_MIB`)."""
        self.chunk_bytes = max(self.chunk_bytes, num_bytes)

    # ----------------------------------------------------------------- tier calls

    async def _call(
        self,
        tier: Tier,
        op: str,
        fn: Callable[[], Awaitable[T]],
        *,
        num_bytes: int = 0,
        extra_s: float = 0.0,
    ) -> T | None:
        """Run one backend call under the tier's breaker and timeout; ``None`` when it failed.

        A write of ``num_bytes`` gets :data:`TRANSFER_SECONDS_PER_MIB` more per MiB, a read the
        ``extra_s`` its caller allows: the timeout tells a dead tier from a live one, not a large
        batch from a small one.
        """
        if not tier.breaker.allow():
            tier.counters.breaker_rejections += 1
            return None
        start = time.perf_counter()
        timeout = (
            None
            if tier.timeout_s is None
            else tier.timeout_s + num_bytes / (1 << 20) * TRANSFER_SECONDS_PER_MIB + extra_s
        )
        try:
            if timeout is None:
                result = await fn()
            else:
                result = await asyncio.wait_for(fn(), timeout)
        except TimeoutError:
            tier.counters.timeouts += 1
            tier.breaker.record_failure()
            log.warning("store tier %s: %s timed out after %.3f s", tier.name, op, timeout)
            return None
        except TierUnavailableError as exc:
            tier.counters.unavailable += 1
            tier.breaker.record_failure()
            log.warning("store tier %s: %s failed: %s", tier.name, op, exc)
            return None
        tier.breaker.record_success()
        self.metrics.observe(tier.name, op, time.perf_counter() - start)
        return result

    # ----------------------------------------------------------------- reads

    async def count_prefix(self, keys: Sequence[StoreKey]) -> int:
        """How many leading ``keys`` some tier holds (no payload is read)."""
        n = (await self._locate(keys)).num_held
        self.num_lookup_chunks += len(keys)
        self.num_lookup_hit_chunks += n
        return n

    async def _locate(self, keys: Sequence[StoreKey]) -> PrefixScan:
        """One existence check per tier: for each key, the fastest reachable tier that holds it."""
        scan = PrefixScan(len(keys))
        for t, tier in enumerate(self.tiers):
            missing = scan.unresolved()
            if not missing:
                break
            answer = await self._call(
                tier, "exists", partial(tier.backend.exists_many, [keys[i] for i in missing])
            )
            if answer is not None:
                scan.record(t, missing, answer)
        return scan

    async def get_prefix(
        self, keys: Sequence[StoreKey], *, beyond: int = 0, read_extra_s: float | None = None
    ) -> PrefixResult:
        """Fetch the longest leading run of ``keys`` that the tiers can serve, verified.

        Each tier is asked once which keys it holds, then each chunk is read once, from the
        fastest tier holding it (from a slower one only when that read fails).

        Args:
            keys: consecutive chunks of one prompt, from its start.
            beyond: read nothing unless the tiers hold more than this many leading chunks (the
                caller has those already): the answer is then empty, with ``num_held`` set.
            read_extra_s: how long a read may outlast its tier's timeout; ``None``: by its size
                (:data:`READ_SECONDS_PER_MIB`, at most :data:`MAX_READ_EXTRA_S`). A caller that no
                request step waits for may allow more.

        Returns:
            The chunks in order; fewer than ``keys`` when a chunk is missing everywhere, fails
            verification everywhere, or sits only behind a failing tier.
        """
        scan = await self._locate(keys)
        bound = scan.num_held
        self.num_lookup_chunks += len(keys)
        self.num_lookup_hit_chunks += bound
        if bound <= beyond:
            return PrefixResult([], bound)
        holder = scan.holder
        found: list[FoundChunk | None] = [None] * bound
        mine: dict[int, asyncio.Future[FoundChunk | None]] = {}
        theirs: dict[int, asyncio.Future[FoundChunk | None]] = {}
        loop = asyncio.get_running_loop()
        for i in range(bound):
            shared = self._inflight.get(keys[i])
            if shared is not None:
                theirs[i] = shared
            else:
                fut: asyncio.Future[FoundChunk | None] = loop.create_future()
                self._inflight[keys[i]] = fut
                mine[i] = fut
        try:
            await self._fetch(keys, holder, sorted(mine), found, read_extra_s)
        finally:
            for i, fut in mine.items():
                if not fut.done():
                    fut.set_result(found[i])
                if self._inflight.get(keys[i]) is fut:
                    del self._inflight[keys[i]]
        for i, fut in theirs.items():
            found[i] = await asyncio.shield(fut)
        chunks: list[FoundChunk] = []
        for item in found:
            if item is None:
                break
            chunks.append(item)
        await self._maybe_promote(keys, chunks)
        return PrefixResult(chunks, bound)

    async def _fetch(
        self,
        keys: Sequence[StoreKey],
        holder: list[int | None],
        wanted: list[int],
        found: list[FoundChunk | None],
        read_extra_s: float | None = None,
    ) -> None:
        """Fill ``found[i]`` for ``i`` in ``wanted``, tier by tier; a failed key falls to later tiers."""
        for t, tier in enumerate(self.tiers):
            todo = [i for i in wanted if found[i] is None and _held_by(holder[i], t)]
            if not todo:
                continue
            batch = [keys[i] for i in todo]
            extra = read_extra_s
            if extra is None:
                extra = min(
                    len(batch) * self.chunk_bytes / (1 << 20) * READ_SECONDS_PER_MIB, MAX_READ_EXTRA_S
                )
            values = await self._call(tier, "get", partial(tier.backend.get_many, batch), extra_s=extra)
            if values is None:
                continue
            decoded = await self._verify(tier, batch, values)
            for i, value, chunk in zip(todo, values, decoded, strict=True):
                if chunk is None or value is None:
                    tier.counters.misses += 1
                    continue
                self.chunk_bytes = max(self.chunk_bytes, len(value))
                tier.counters.hits += 1
                tier.counters.bytes_read += len(value)
                found[i] = FoundChunk(chunk, tier.name, value)

    async def _verify(
        self, tier: Tier, keys: list[StoreKey], values: list[ChunkData | None]
    ) -> list[DecodedChunk | None]:
        def run(part: range) -> list[DecodedChunk | BaseException | None]:
            out: list[DecodedChunk | BaseException | None] = []
            for i in part:
                value = values[i]
                if value is None:
                    out.append(None)
                    continue
                try:
                    out.append(self.codec.decode(value, expected=keys[i]))
                except CorruptChunkError as exc:
                    out.append(exc)
            return out

        total = sum(len(v) for v in values if v is not None)
        if total <= _DECODE_IN_THREAD_BYTES:
            results = run(range(len(values)))
        else:
            # Checksums release the GIL: a long prefix is verified on several threads (a mapped
            # chunk's pages are faulted in by its checksum, in parallel too).
            n = min(VERIFY_THREADS, len(values), max(1, total // _DECODE_IN_THREAD_BYTES))
            step = -(-len(values) // n)
            parts = [range(i, min(i + step, len(values))) for i in range(0, len(values), step)]
            results = [
                r for rs in await asyncio.gather(*(asyncio.to_thread(run, p) for p in parts)) for r in rs
            ]
        corrupt: list[StoreKey] = []
        decoded: list[DecodedChunk | None] = []
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, BaseException):
                tier.counters.corrupt += 1
                log.warning("store tier %s: corrupt chunk %s deleted: %s", tier.name, key.name(), result)
                corrupt.append(key)
                decoded.append(None)
            else:
                decoded.append(result)
        if corrupt:
            await self._write(tier, _WriteOp("delete", keys=corrupt))
        return decoded

    async def _maybe_promote(self, keys: Sequence[StoreKey], chunks: list[FoundChunk]) -> None:
        index = {t.name: n for n, t in enumerate(self.tiers)}
        for n, tier in enumerate(self.tiers):
            if not tier.promote:
                continue
            items = [(keys[i], c.data) for i, c in enumerate(chunks) if index[c.tier] > n]
            if not tier.queued:
                # A mapped chunk file already lies in memory (files are mapped where the directory
                # is memory-backed): an inline (RAM) tier would only double it, with a copy that
                # competes with the request for the cores; keeping the mapping instead would pin
                # the file's pages and disk space, and a mapping, for as long as the entry lived.
                items = [(key, value) for key, value in items if isinstance(value, bytes)]
            if not items:
                continue
            tier.counters.promotions += len(items)
            if tier.queued:
                self._enqueue(tier, _WriteOp("promote", items=items))
            else:
                await self._write(tier, _WriteOp("promote", items=items))

    # ----------------------------------------------------------------- writes

    async def held_by_first_tier(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether the fastest tier holds each key (all ``False`` when it cannot answer)."""
        if not self.tiers or not keys:
            return [False] * len(keys)
        tier = self.tiers[0]
        answer = await self._call(tier, "exists", partial(tier.backend.exists_many, list(keys)))
        return [False] * len(keys) if answer is None else answer

    async def put(
        self,
        items: Sequence[tuple[StoreKey, ChunkData]],
        on_written: TierWritten | None = None,
        vouch: Sequence[StoreKey] = (),
    ) -> None:
        """Write encoded chunks to every tier: inline tiers now, queued tiers by their worker.

        A tier that already holds a key skips it. Never raises for a tier failure and never waits
        for a queued tier.

        Args:
            items: encoded chunks.
            on_written: called once per tier whose write succeeded (or that held every key
                already), with the keys it now holds; a dropped write (full queue, open breaker,
                timeout, unavailable backend) calls nothing.
            vouch: other keys each tier checks (not writes) for the report: a caller that skipped
                chunks learns which of them that tier really holds.
        """
        if not items:
            return
        batch = list(items)
        self.chunk_bytes = max(self.chunk_bytes, max(len(v) for _, v in batch))
        vouched = list(vouch) if on_written is not None else []
        for tier in self.tiers:
            op = _WriteOp("put", items=batch, on_written=on_written, vouch=vouched)
            if tier.queued:
                self._enqueue(tier, op)
            else:
                await self._write(tier, op)

    def _enqueue(self, tier: Tier, op: _WriteOp) -> None:
        size = op.num_bytes
        # Over the cap only behind other writes: a lone write larger than the cap (one long
        # prompt) is taken, else such prompts would never reach this tier.
        if self._closed or (tier.queue_bytes > 0 and tier.queue_bytes + size > tier.max_queue_bytes):
            tier.counters.dropped_writes += len(op.items) or len(op.keys)
            op.resolve(None)
            return
        if tier._queue is None:
            tier._queue = asyncio.Queue()
            tier._worker = asyncio.get_running_loop().create_task(
                self._drain_queue(tier), name=f"kvmesh-store-{tier.name}-writer"
            )
        tier.queue_bytes += size
        tier._queue.put_nowait(op)

    async def _drain_queue(self, tier: Tier) -> None:
        queue = tier._queue
        assert queue is not None, "writer started without a queue"
        while True:
            op = await queue.get()
            try:
                if op is None:
                    return
                await self._write(tier, op)
            except Exception:
                log.exception("store tier %s: write worker error", tier.name)
                if op is not None:
                    tier.counters.dropped_writes += len(op.items)
                    op.resolve(None)
            finally:
                if op is not None:
                    tier.queue_bytes -= op.num_bytes
                queue.task_done()
            # Not held while waiting for the next write: its chunks may map files.
            del op

    async def _write(self, tier: Tier, op: _WriteOp) -> None:
        backend = tier.backend
        if op.kind == "delete":
            await self._call(tier, "delete", partial(backend.delete_many, op.keys))
            return
        if op.kind == "pin":
            assert op.pin is not None, "pin op without its ledger call"
            op.resolve(await self._call(tier, "pin", op.pin))
            return
        items = op.items
        held: list[StoreKey] = []
        if op.kind == "put":
            checked = [k for k, _ in items] + op.vouch
            present = await self._call(tier, "exists", partial(backend.exists_many, checked))
            if present is None:
                tier.counters.dropped_writes += len(items)
                return
            n = len(items)
            held = [key for (key, _), there in zip(items, present[:n], strict=True) if there]
            held += [key for key, there in zip(op.vouch, present[n:], strict=True) if there]
            items = [item for item, there in zip(items, present[:n], strict=True) if not there]
            if not items:
                _maybe_report(tier, op, held)
                return
        stored = await self._call(
            tier, "put", partial(backend.put_many, items), num_bytes=sum(len(v) for _, v in items)
        )
        if stored is None:
            tier.counters.dropped_writes += len(items)
            return
        tier.counters.bytes_written += sum(len(v) for _, v in items)
        # A short count does not say which items were left out, so none of them is reported.
        _maybe_report(tier, op, held + [key for key, _ in items] if stored >= len(items) else held)

    async def drain(self, tiers: Collection[str] | None = None) -> None:
        """Wait until every queued write issued so far has been attempted (in the tiers named in
        ``tiers``, or all)."""
        for tier in self.tiers:
            if tier._queue is not None and (tiers is None or tier.name in tiers):
                await tier._queue.join()

    async def pin(
        self,
        keys: Sequence[StoreKey],
        tenant: str,
        ttl_s: float,
        budgets: Mapping[str, int],
        *,
        estimate_bytes: int | None = None,
    ) -> dict[str, PinOutcome | None]:
        """Pin ``keys`` in every tier that can pin and where ``budgets`` gives the tenant bytes.

        A queued tier pins after the writes queued before this call (a prompt's chunks written
        just before are there to pin). A check (``estimate_bytes`` set) runs at once and changes
        nothing.

        Args:
            keys: chunk keys of the tenant's namespace.
            tenant: whose budget pays.
            ttl_s: the pin's lifetime in seconds from when the tier takes it.
            budgets: bytes per tier name; tiers missing or at 0 are skipped.
            estimate_bytes: check only, counting a chunk the tier lacks at this size.

        Returns:
            Per tier asked, its outcome; ``None`` where the tier failed or dropped the request.
        """
        out: dict[str, PinOutcome | None] = {}
        waiting: dict[str, asyncio.Future[PinOutcome | None]] = {}
        for tier in self.tiers:
            budget = budgets.get(tier.name, 0)
            ledger = pin_ledger(tier.backend)
            if budget <= 0 or ledger is None:
                continue
            call = partial(ledger.pin_many, PinRequest(list(keys), tenant, ttl_s, budget, estimate_bytes))
            if estimate_bytes is not None or not tier.queued:
                out[tier.name] = await self._call(tier, "pin", call)
                continue
            done: asyncio.Future[PinOutcome | None] = asyncio.get_running_loop().create_future()
            self._enqueue(tier, _WriteOp("pin", pin=call, done=done))
            waiting[tier.name] = done
        for name, done in waiting.items():
            out[name] = await done
        return out

    # ----------------------------------------------------------------- admin

    async def delete(self, keys: Sequence[StoreKey]) -> None:
        """Delete ``keys`` from every tier (queued tiers through their queue)."""
        for tier in self.tiers:
            op = _WriteOp("delete", keys=list(keys))
            if tier.queued:
                self._enqueue(tier, op)
            else:
                await self._write(tier, op)

    async def flush(
        self, group: str | None = None, tiers: Collection[str] | None = None
    ) -> dict[str, int | None]:
        """Delete every chunk of ``group`` (all chunks when ``None``) from every tier, or from the
        tiers named in ``tiers``.

        Queued writes to those tiers are drained first so none lands after the flush.

        Returns:
            Chunks removed per tier; ``None`` for a tier that could not be reached.
        """
        await self.drain(tiers)
        out: dict[str, int | None] = {}
        for tier in self.tiers:
            if tiers is None or tier.name in tiers:
                out[tier.name] = await self._call(tier, "flush", partial(tier.backend.flush, group))
        return out

    def snapshots(self) -> list[TierSnapshot]:
        """Counters and gauges of every tier (what the metrics collector reads)."""
        return [
            TierSnapshot(
                name=t.name,
                counters=t.counters,
                breaker_state=int(t.breaker.state),
                queue_bytes=t.queue_bytes,
                num_evictions=int(getattr(t.backend, "num_evictions", 0)),
                num_bytes=int(getattr(t.backend, "num_bytes", -1)),
            )
            for t in self.tiers
        ]

    def _lookup_totals(self) -> tuple[int, int]:
        return self.num_lookup_chunks, self.num_lookup_hit_chunks

    async def stats(self) -> dict[str, object]:
        """Per-tier backend stats (``None`` for an unreachable tier), breaker and counters."""
        tiers: dict[str, object] = {}
        for tier in self.tiers:
            backend = tier.backend
            bstats = await self._call(tier, "stats", backend.stats)
            tiers[tier.name] = {
                "backend": None if bstats is None else bstats.to_dict(),
                "breaker": tier.breaker.state.name.lower(),
                "queue_bytes": tier.queue_bytes,
                "counters": tier.counters.to_dict(),
            }
        return {"tiers": tiers}

    async def aclose(self) -> None:
        """Finish queued writes (up to 5 s), stop the workers and close every backend."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.drain(), _CLOSE_DRAIN_S)
        for tier in self.tiers:
            await cancel_and_wait([tier._worker])
            tier._worker = None
            while tier._queue is not None and not tier._queue.empty():
                left = tier._queue.get_nowait()
                if left is not None:
                    left.resolve(None)
            await tier.backend.aclose()


def _maybe_report(tier: Tier, op: _WriteOp, keys: list[StoreKey]) -> None:
    if op.on_written is not None and keys:
        op.on_written(tier.name, keys)


def _held_by(holder: int | None, tier_index: int) -> bool:
    """Whether a key located in tier ``holder`` may be fetched from tier ``tier_index``."""
    return holder is not None and holder <= tier_index
