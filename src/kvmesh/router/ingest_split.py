"""Event ingestion split across ``kvmesh router --workers N``: each pod's events are decoded,
keyed and applied by one worker, which sends the resulting index writes to the others.

Without it every worker subscribes to every engine and does all the work of every event (decode,
re-hash the tokens, track the engine's hashes), so N workers ingest no faster than one. Split, a
worker does that work for the pods it owns (:func:`ingest_owner`: the configured endpoints dealt
out in order, any other pod by a stable hash of its id) and applies the others' results, which
are only index writes (``add``/``remove``/``clear_pod`` with router keys), 0.2–0.4 of an event's
cost::

    engine A ─events─► worker 0: decode, key, track ──► own index
                                      │ writes (msgpack, ZMQ PUB over ipc)
                                      ▼
                         worker 1: apply ──► own index          (and the other way round)

Every worker still holds the whole index, so routing reads stay in process. A worker publishes on
an ``XPUB`` socket: each time a peer subscribes (a peer that just started, or one that saw a gap
in this worker's sequence numbers and subscribed again) it sends a snapshot of what its pods hold,
so a late or lossy peer converges. A worker that (re)starts clears its pods in the others before
its own replay from the engines arrives.

The fleet's shared-tier holder is written by every worker (any pod's events may move blocks
there), so its keys are counted per worker that announced them and leave the index when the last
one removes them. A shared block whose removal reaches a worker that never learnt it (its store
event came through another pod than the one that announced it) stays until the announcing worker
removes it or its key ages out of the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import xxhash
import zmq
import zmq.asyncio

from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.router.index import (
    ALL_MEDIA,
    MEDIUM_BITS,
    SHARED_TIER_HOLDER,
    BlockIndex,
    Holders,
    IndexStats,
    MediumSet,
)
from kvmesh.router.split_shared import SharedHolderKeys
from kvmesh.router.split_wire import IndexOp, IndexOps, OpKind, decode_ops, encode_ops, split_keys

logger = logging.getLogger(__name__)

_SHARED_BIT = MEDIUM_BITS[Medium.SHARED]
_SHARED_SET = MediumSet(_SHARED_BIT)

_RESYNC_TOPIC = b"\x00resync"

_DRAIN_MAX = 64
"""Queued peer messages applied before the event loop gets a turn."""

_MEDIA_SETS = {bits: MediumSet(bits) for bits in range(int(ALL_MEDIA) + 1)}
"""Every tier set by its bits (an enum call per write costs more than the write's dict update)."""


def ingest_owner(pod: PodId, num_workers: int) -> int:
    """The worker that ingests the events of a pod that is not a configured endpoint (one found by
    DNS or added at run time): a hash of its id, the same in every worker and every run.
    Configured endpoints are dealt out in order instead (:class:`IngestSplit`)."""
    return xxhash.xxh3_64_intdigest(pod.encode()) % num_workers


@dataclass(frozen=True)
class IngestSplit:
    """Where one worker sits among the workers that split ingestion.

    Args:
        worker: this worker's index.
        num_workers: how many split ingestion.
        directory: where the workers' sockets live (one per worker and scope).
        scope: which router's split this is (a pool's name under ``pools:``).
        placed: the configured endpoints' pods, which every worker reads from the same config:
            they are dealt out in sorted order, so a static fleet spreads evenly; any other pod
            goes by :func:`ingest_owner`.
    """

    worker: int
    num_workers: int
    directory: str
    scope: str = ""
    placed: tuple[PodId, ...] = ()
    _owners: dict[PodId, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.worker < self.num_workers:
            raise ValueError(f"worker {self.worker} is not one of {self.num_workers}")
        ordered = sorted(set(self.placed))
        object.__setattr__(self, "_owners", {pod: i % self.num_workers for i, pod in enumerate(ordered)})

    def endpoint(self, worker: int) -> str:
        """Worker ``worker``'s publishing socket."""
        tag = xxhash.xxh3_64_hexdigest(self.scope.encode())[:8] if self.scope else "default"
        return f"ipc://{Path(self.directory) / f'ingest-{tag}-{worker}.sock'}"

    def owns(self, pod: PodId) -> bool:
        """Whether this worker ingests ``pod``'s events."""
        owner = self._owners.get(pod)
        if owner is None:
            owner = self._owners[pod] = ingest_owner(pod, self.num_workers)
        return owner == self.worker

    def for_scope(self, scope: str) -> IngestSplit:
        """The same worker's place in another router's split (one per pool)."""
        return IngestSplit(self.worker, self.num_workers, self.directory, scope, self.placed)

    def placing(self, pods: Iterable[PodId]) -> IngestSplit:
        """This split with ``pods`` dealt out evenly (a router's configured endpoints)."""
        return IngestSplit(self.worker, self.num_workers, self.directory, self.scope, tuple(pods))


@dataclass
class SplitStats:
    """What a worker sent to and took from its peers."""

    num_messages_sent: int = 0
    num_ops_sent: int = 0
    num_messages_received: int = 0
    num_ops_applied: int = 0
    num_snapshots_sent: int = 0
    num_gaps: int = 0
    num_malformed: int = 0
    num_peer_restarts: int = 0


@dataclass
class _Peer:
    incarnation: int
    last_seq: int


@dataclass
class SplitIngest:
    """One worker's side of split ingestion; also the index its event applier writes to.

    Writes from this worker's applier go to ``local`` and into the next message to the peers;
    peers' messages are applied to ``local``. Lookups read ``local``.

    Args:
        split: this worker's place.
        local: this worker's index (as the applier would write it: the seen-block memory included).
        held: what ``local`` holds for a set of pods, ``(pod, tiers) → keys`` (for snapshots).
        owned_pods: the pods this worker ingests now.
        block_sizes: this worker's pods' engine block sizes, as its applier learnt them.
        on_block_size: a peer's pod's engine block size.
    """

    split: IngestSplit
    local: BlockIndex
    held: Callable[[set[PodId]], dict[tuple[PodId, MediumSet], list[BlockKey]]]
    owned_pods: Callable[[], Iterable[PodId]]
    block_sizes: Callable[[], dict[PodId, int]]
    on_block_size: Callable[[PodId, int], None]
    link_stats: SplitStats = field(default_factory=SplitStats)

    def __post_init__(self) -> None:
        self.shared = SharedHolderKeys(self.local)
        self.incarnation = int.from_bytes(os.urandom(8), "big") >> 1
        self._seq = 0
        self._outbox: list[IndexOp] = []
        self._peers: dict[int, _Peer] = {}
        self._sent_sizes: dict[PodId, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._resyncs = 0

    # ------------------------------------------------------------------ BlockIndex, for the applier

    def add(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet) -> None:
        if pod == SHARED_TIER_HOLDER:
            self.shared.add(self.split.worker, keys, media)
        else:
            self.local.add(keys, pod, media)
        self._queue(IndexOp(OpKind.ADD, pod, media, b"".join(keys)))

    def remove(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet = ALL_MEDIA) -> None:
        if pod == SHARED_TIER_HOLDER:
            self.shared.remove(self.split.worker, keys, media)
        else:
            self.local.remove(keys, pod, media)
        self._queue(IndexOp(OpKind.REMOVE, pod, media, b"".join(keys)))

    def clear_pod(self, pod: PodId) -> int | None:
        self._queue(IndexOp(OpKind.CLEAR, pod))
        if pod == SHARED_TIER_HOLDER:
            return self.shared.clear(self.split.worker)
        return self.local.clear_pod(pod)

    def lookup(self, keys: Iterable[BlockKey]) -> list[Holders]:
        return self.local.lookup(keys)

    def stats(self) -> IndexStats:
        return self.local.stats()

    # ------------------------------------------------------------------ the owner's side

    def pod_added(self, pod: PodId) -> None:
        """This worker starts ingesting ``pod`` (its replay follows): the peers drop what they
        held for it, which a previous owner's run may have left."""
        self._queue(IndexOp(OpKind.CLEAR, pod))

    def _queue(self, op: IndexOp) -> None:
        pod = PodId(op.pod)
        if pod != SHARED_TIER_HOLDER and not self.split.owns(pod):
            # Another worker's pod, forgotten here (an endpoint removed): its owner tells the rest.
            return
        if not self._outbox and self._loop is not None:
            self._loop.call_soon(self.flush)
        self._outbox.append(op)

    def flush(self) -> None:
        """Send what was written since the last message (called on the loop after each write burst)."""
        # A pod's block size is learnt from the same events that wrote: checked with each burst.
        for pod, size in self.block_sizes().items():
            if self._sent_sizes.get(pod) != size:
                self._sent_sizes[pod] = size
                self._outbox.append(IndexOp(OpKind.BLOCK_SIZE, pod, size))
        if not self._outbox:
            return
        ops, self._outbox = self._outbox, []
        self._send(ops)

    def _send(self, ops: list[IndexOp]) -> None:
        if self._pub is None:
            return
        self._seq += 1
        payload = encode_ops(IndexOps(self.split.worker, self.incarnation, self._seq, ops))
        try:
            self._pub.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # A peer this far behind sees the gap in our sequence and asks for a snapshot.
            logger.warning("ingest split: message %d not sent: %s", self._seq, exc)
            return
        self.link_stats.num_messages_sent += 1
        self.link_stats.num_ops_sent += len(ops)

    def snapshot(self) -> list[IndexOp]:
        """Everything this worker's pods hold, as writes that replace a peer's view of them."""
        owned = set(self.owned_pods())
        ops = [IndexOp(OpKind.CLEAR, pod) for pod in sorted(owned)]
        for (pod, media), keys in self.held(owned).items():
            ops.append(IndexOp(OpKind.ADD, pod, media, b"".join(keys)))
        ops.append(IndexOp(OpKind.CLEAR, SHARED_TIER_HOLDER))
        shared = self.shared.keys_of(self.split.worker)
        if shared:
            ops.append(IndexOp(OpKind.ADD, SHARED_TIER_HOLDER, _SHARED_SET, b"".join(shared)))
        sizes = self.block_sizes()
        ops.extend(IndexOp(OpKind.BLOCK_SIZE, pod, size) for pod, size in sizes.items() if pod in owned)
        return ops

    def send_snapshot(self) -> None:
        """Send :meth:`snapshot` (after whatever is queued, so the order of writes holds)."""
        self.flush()
        self._send(self.snapshot())
        self.link_stats.num_snapshots_sent += 1

    # ------------------------------------------------------------------ the peers' side

    def apply(self, message: IndexOps) -> None:
        """Apply a peer's writes to the local index."""
        peer = self._peers.get(message.origin)
        if peer is None or peer.incarnation != message.incarnation:
            if peer is not None:
                # The peer restarted: its shared-tier keys are announced again from scratch; its
                # pods are cleared by its own first writes.
                self.link_stats.num_peer_restarts += 1
                self.shared.clear(message.origin)
            self._peers[message.origin] = _Peer(message.incarnation, message.seq)
            if peer is not None or message.seq != 1:
                self._ask_resync()
        else:
            if message.seq != peer.last_seq + 1:
                self.link_stats.num_gaps += 1
                self._ask_resync()
            peer.last_seq = message.seq
        self.link_stats.num_messages_received += 1
        origin, local, shared = message.origin, self.local, self.shared
        owns, media_sets = self.split.owns, _MEDIA_SETS
        for op in message.ops:
            kind, pod = op.kind, PodId(op.pod)
            if pod != SHARED_TIER_HOLDER and owns(pod):
                continue  # this worker's own pod: what its events say stands
            if kind == OpKind.BLOCK_SIZE:
                self.on_block_size(pod, op.arg)
            elif kind == OpKind.CLEAR:
                if pod == SHARED_TIER_HOLDER:
                    shared.clear(origin)
                else:
                    local.clear_pod(pod)
            else:
                keys = split_keys(op.keys)
                media = media_sets.get(op.arg) or MediumSet(op.arg)
                if pod == SHARED_TIER_HOLDER:
                    if kind == OpKind.ADD:
                        shared.add(origin, keys, media)
                    else:
                        shared.remove(origin, keys, media)
                elif kind == OpKind.ADD:
                    local.add(keys, pod, media)
                else:
                    local.remove(keys, pod, media)
        self.link_stats.num_ops_applied += len(message.ops)

    def _ask_resync(self) -> None:
        """Subscribe once more (to a new topic): every peer's XPUB sees it and sends a snapshot."""
        if self._sub is None:
            return
        self._resyncs += 1
        self._sub.setsockopt(zmq.SUBSCRIBE, _RESYNC_TOPIC + self._resyncs.to_bytes(8, "big"))

    # ------------------------------------------------------------------ sockets

    def start(self) -> None:
        """Bind this worker's socket, connect to the peers' and start receiving (on the running loop)."""
        if self._ctx is not None:
            return
        self._loop = asyncio.get_running_loop()
        ctx = self._ctx = zmq.asyncio.Context()
        pub = self._pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        pub.setsockopt(zmq.SNDHWM, 1_000_000)
        own = self.split.endpoint(self.split.worker)
        with contextlib.suppress(FileNotFoundError):
            # a previous run's (or a crashed predecessor's) socket file
            Path(own.removeprefix("ipc://")).unlink()
        pub.bind(own)
        sub = self._sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 1_000_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for worker in range(self.split.num_workers):
            if worker != self.split.worker:
                sub.connect(self.split.endpoint(worker))
        self._tasks = [
            self._loop.create_task(self._receive()),
            self._loop.create_task(self._serve_subscribers()),
        ]
        if self._outbox:
            # written before the sockets existed (the owner's first clears): sent now, in order
            self._loop.call_soon(self.flush)

    async def aclose(self) -> None:
        """Stop receiving and close the sockets."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._sub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._loop = None

    async def _receive(self) -> None:
        assert self._sub is not None
        sub = self._sub
        queued: zmq.Socket[bytes] = zmq.Socket.shadow(
            sub.underlying
        )  # direct reads of what is already queued
        while True:
            self._take(await sub.recv())
            for _ in range(_DRAIN_MAX):
                try:
                    payload = queued.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._take(payload)
            else:
                await asyncio.sleep(0)

    def _take(self, payload: bytes) -> None:
        try:
            message = decode_ops(payload)
            self.apply(message)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self.link_stats.num_malformed += 1
            logger.warning("ingest split: malformed message from a peer skipped: %s", exc)

    async def _serve_subscribers(self) -> None:
        assert self._pub is not None
        pub = self._pub
        while True:
            note = await pub.recv()
            if note[:1] == b"\x01":
                self.send_snapshot()
