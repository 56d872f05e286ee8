"""Event intake: every endpoint's KV event stream feeds the block index.

One :class:`~kvmesh.core.event_transport.ZmqEventSubscriber` receives from all publishers on the
router's event loop; batches are applied in seq order per pod by an
:class:`~kvmesh.router.ingest.EventApplier`, so the index is mutated from that loop only. Gaps are
filled from the publisher's replay socket by the subscriber; a publisher restart (seq reset) drops
the pod's blocks before its new history is applied. Adding a publisher replays its buffered
history first, which is how a restarted router rebuilds its index.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvmesh.core.event_transport import ZmqEventSubscriber
from kvmesh.core.events import KVEventBatch
from kvmesh.core.tasks import cancel_and_wait
from kvmesh.core.types import PodId
from kvmesh.errors import TierUnavailableError
from kvmesh.router.ingest import EventApplier

logger = logging.getLogger(__name__)


class EventIntake:
    """Subscribes to pods' event streams and applies them to the index.

    Args:
        applier: turns events into index updates.
        topic: ZMQ subscription prefix ("" takes every topic).
        on_lag: called with the seconds from each batch's publication (its ``ts``, the publisher's
            wall clock) to its application.
    """

    def __init__(
        self, applier: EventApplier, *, topic: str = "", on_lag: Callable[[float], None] | None = None
    ) -> None:
        self.applier = applier
        self.on_lag = on_lag
        self.subscriber = ZmqEventSubscriber(self._on_batch, self._on_reset, topic=topic)
        self._task: asyncio.Task[None] | None = None
        self._sources: dict[PodId, tuple[str, str | None]] = {}
        self.num_index_failures = 0
        """Batches or resets the index could not take (shared index unreachable)."""

    @property
    def sources(self) -> dict[PodId, tuple[str, str | None]]:
        """Each subscribed pod's (events endpoint, replay endpoint)."""
        return dict(self._sources)

    def add_pod(self, pod: PodId, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Subscribe to ``pod``'s events (replaying its buffered history when it has a replay socket).

        Re-adding a pod with the same endpoints is a no-op; with new endpoints, its old blocks are
        dropped first.
        """
        if self._sources.get(pod) == (endpoint, replay_endpoint):
            return
        if pod in self._sources:
            self.remove_pod(pod)
        self._sources[pod] = (endpoint, replay_endpoint)
        self.subscriber.add_publisher(pod, endpoint, replay_endpoint)

    def remove_pod(self, pod: PodId) -> None:
        """Stop receiving from ``pod`` and forget its blocks and learned block size."""
        self._sources.pop(pod, None)
        self.subscriber.remove_publisher(pod)
        self.applier.forget_pod(pod)

    def start(self) -> None:
        """Start receiving on the running loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.subscriber.run())

    async def aclose(self) -> None:
        """Stop receiving and close every socket."""
        await self.subscriber.aclose()
        await cancel_and_wait([self._task])
        self._task = None

    def _on_batch(self, pod: PodId, seq: int, batch: KVEventBatch) -> None:
        try:
            self.applier.apply_batch(pod, batch)
            if self.on_lag is not None and batch.ts > 0:
                self.on_lag(max(0.0, time.time() - batch.ts))
        except TierUnavailableError as exc:
            # A shared index that is down loses these updates; routing degrades, events keep flowing.
            self.num_index_failures += 1
            logger.warning("index unavailable, batch %d of %s not applied: %s", seq, pod, exc)

    def _on_reset(self, pod: PodId) -> None:
        logger.info("event publisher of %s restarted; dropping its blocks", pod)
        try:
            self.applier.publisher_restarted(pod)
        except TierUnavailableError as exc:
            self.num_index_failures += 1
            logger.warning("index unavailable, blocks of restarted %s not dropped: %s", pod, exc)
