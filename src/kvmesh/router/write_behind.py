"""Index writes off the event loop: a remote index written from one background thread.

The event intake applies KV events on the router's loop; with a shared index (Redis/Valkey) each
``add``/``remove``/``clear_pod`` is a network round trip. :class:`WriteBehindIndex` queues them
instead and one writer thread applies them in order, as many as have piled up in one batch (one
pipelined round trip for a :class:`BatchWritable` backend such as
:class:`~kvmesh.router.redis_index.RedisIndex`)::

    loop:    add/remove/clear_pod ─► pending (bounded) ─┐
    writer:                          take all pending ◄─┘ ─► inner.write_batch(ops) ─► applied seq
    worker:  lookup/stats ─► wait until every write queued before the call is applied ─► inner

Reads wait for the writes queued before them, so a lookup sees this router's own updates; they do
network I/O and belong on a worker thread (the gateway matches there). When the server is down a
batch is lost (counted), as the same events were lost before; a full queue drops new writes
(counted) rather than stall the loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

from kvmesh.core.types import BlockKey, PodId
from kvmesh.errors import TierUnavailableError
from kvmesh.router.index import ALL_MEDIA, BlockIndex, Holders, IndexStats, MediumSet

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 65_536
"""Writes queued at most; past it new writes are dropped (and counted)."""


@dataclass(frozen=True, slots=True)
class AddBlocks:
    """:meth:`BlockIndex.add` as a queued write."""

    keys: tuple[BlockKey, ...]
    pod: PodId
    media: MediumSet


@dataclass(frozen=True, slots=True)
class RemoveBlocks:
    """:meth:`BlockIndex.remove` as a queued write."""

    keys: tuple[BlockKey, ...]
    pod: PodId
    media: MediumSet


@dataclass(frozen=True, slots=True)
class ClearPod:
    """:meth:`BlockIndex.clear_pod` as a queued write."""

    pod: PodId


IndexWrite: TypeAlias = AddBlocks | RemoveBlocks | ClearPod


@runtime_checkable
class BatchWritable(Protocol):
    """A backend that applies a run of writes at once (in order, as if one by one)."""

    def write_batch(self, writes: Sequence[IndexWrite]) -> None:
        """Apply ``writes`` in order.

        Raises:
            TierUnavailableError: the backend cannot be reached (some writes may be lost).
        """
        ...


def apply_writes(index: BlockIndex, writes: Iterable[IndexWrite]) -> None:
    """Apply ``writes`` to ``index`` one call each, in order."""
    for write in writes:
        match write:
            case AddBlocks(keys, pod, media):
                index.add(keys, pod, media)
            case RemoveBlocks(keys, pod, media):
                index.remove(keys, pod, media)
            case ClearPod(pod):
                index.clear_pod(pod)


class WriteBehindIndex:
    """A :class:`BlockIndex` whose writes a background thread applies to ``inner``.

    Args:
        inner: the remote index.
        max_pending: most writes queued; later ones are dropped until the writer catches up.
        read_wait_s: how long a read waits for earlier writes before reading anyway.

    Nothing is written until :meth:`start`.

    Attributes:
        num_failed_batches: batches the backend could not take (server unreachable).
        num_dropped: writes dropped because the queue was full.
    """

    def __init__(
        self, inner: BlockIndex, *, max_pending: int = DEFAULT_MAX_PENDING, read_wait_s: float = 2.0
    ) -> None:
        if max_pending <= 0:
            raise ValueError(f"max_pending must be positive, got {max_pending}")
        self.inner = inner
        self.max_pending = max_pending
        self.read_wait_s = read_wait_s
        self.num_failed_batches = 0
        self.num_dropped = 0
        self._pending: list[IndexWrite] = []
        self._queued = 0
        """Writes accepted so far (a sequence number)."""
        self._applied = 0
        """Writes the writer has finished with (applied or lost), in queue order."""
        self._cond = threading.Condition()
        self._closing = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvmesh-index-writer", daemon=True)

    def start(self) -> None:
        """Start the writer thread; writes queued before are applied first."""
        if not self._thread.is_alive():
            self._thread.start()

    # ------------------------------------------------------------------ writes (any thread)

    def add(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet) -> None:
        if keys:
            self._enqueue(AddBlocks(tuple(keys), pod, media))

    def remove(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet = ALL_MEDIA) -> None:
        if keys:
            self._enqueue(RemoveBlocks(tuple(keys), pod, media))

    def clear_pod(self, pod: PodId) -> int | None:
        """Queue dropping every block of ``pod``.

        Returns:
            ``None``: the entries are dropped in the background, so their number is not known yet.
        """
        self._enqueue(ClearPod(pod))
        return None

    def _enqueue(self, write: IndexWrite) -> None:
        with self._cond:
            if self._stopped:
                raise TierUnavailableError("the index writer has stopped")
            if len(self._pending) >= self.max_pending:
                if not self.num_dropped:
                    logger.warning("index writer is %d writes behind: dropping writes", self.max_pending)
                self.num_dropped += 1
                return
            self._pending.append(write)
            self._queued += 1
            self._cond.notify_all()

    # ------------------------------------------------------------------ reads (a worker thread)

    def lookup(self, keys: Iterable[BlockKey]) -> list[Holders]:
        self.wait_written(self.read_wait_s)
        return self.inner.lookup(keys)

    def stats(self) -> IndexStats:
        self.wait_written(self.read_wait_s)
        return self.inner.stats()

    def wait_written(self, timeout: float | None = None) -> bool:
        """Block until every write queued before this call is applied (or lost).

        Returns:
            ``False`` when ``timeout`` seconds passed first.
        """
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._applied >= target or self._stopped, timeout)

    @property
    def num_pending(self) -> int:
        """Writes queued and not yet taken by the writer."""
        with self._cond:
            return len(self._pending)

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._pending or self._closing)
                    if not self._pending:
                        return
                    batch, self._pending = self._pending, []
                try:
                    if isinstance(self.inner, BatchWritable):
                        self.inner.write_batch(batch)
                    else:
                        apply_writes(self.inner, batch)
                except TierUnavailableError as exc:
                    self.num_failed_batches += 1
                    logger.warning("index unavailable, %d writes not applied: %s", len(batch), exc)
                with self._cond:
                    self._applied += len(batch)
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._stopped = True
                self._cond.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Apply what is queued (for at most ``timeout`` seconds) and stop the writer.

        ``inner`` stays open: it belongs to whoever made it.
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)


def _conforms(index: WriteBehindIndex) -> BlockIndex:
    return index
