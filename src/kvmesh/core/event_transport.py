# Over 450 lines: the publisher and the subscriber speak one wire protocol (topic, sequence numbers, replay) and are read together; apart, each would restate the other's framing.
"""ZMQ transport for KV events, wire-compatible with vLLM's publisher and subscribers.

Publisher (sockets bound by the publisher; frames as the peer sees them)::

    PUB    bind endpoint         [topic, seq: u64 big-endian, payload: msgpack batch]

    ROUTER bind replay_endpoint  DEALER sends   [b"", start_seq: u64 big-endian]
                                 (ROUTER sees   [identity, b"", start_seq])
                                 DEALER gets    [b"", topic, seq, payload]   per buffered batch, seq >= start
                                                [b"", b"", END, b""]         end marker
                                 where END = -1 as i64 big-endian (8 x 0xff)

This four-frame replay answer is vLLM's current one and the one :class:`ZmqEventPublisher` sends.
Older vLLM and kvmesh publishers answered without the topic frame, ``[b"", seq, payload]`` and
``[b"", END, b""]``; the subscriber accepts both, and counts any other reply as malformed.

``seq`` starts at 0 and restarts at 0 when a publisher restarts. The subscriber keeps the last seq per
publisher: a gap triggers a replay request, a seq that goes backwards means the publisher restarted
(its blocks are gone), and a frame that does not parse is counted and skipped, never raised.

The publisher's sockets live on one sender thread fed by a bounded queue, so ``publish`` never
blocks the engine loop; when the queue is full the batch is dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import xxhash
import zmq
import zmq.asyncio

from kvmesh.core.events import KVEvent, KVEventBatch, decode_batch, encode_batch
from kvmesh.core.types import PodId
from kvmesh.errors import ProtocolError

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
DEFAULT_TOPIC = "kv-events"
_SENTINEL = object()


def _bindable(endpoint: str) -> str:
    """Let ``tcp://host:0`` mean an ephemeral port, as ``tcp://host:*`` does for ZMQ."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


class EventPublisher(Protocol):
    """Where an engine sends its KV events."""

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch; never blocks."""
        ...

    def close(self) -> None:
        """Flush what is queued (bounded wait) and release the sockets."""
        ...


class NullEventPublisher:
    """Publishes nothing: the default when no endpoint is configured."""

    num_published = 0
    num_dropped = 0

    def publish(self, events: list[KVEvent]) -> None:
        return None

    def close(self) -> None:
        return None


class ZmqEventPublisher:
    """vLLM-compatible KV event publisher (PUB + ROUTER replay from a ring buffer).

    Args:
        endpoint: PUB bind address, e.g. ``tcp://127.0.0.1:5557`` (``:0`` = ephemeral).
        replay_endpoint: ROUTER bind address for replay, or ``None`` for no replay.
        topic: first frame of every message.
        buffer_steps: batches kept for replay.
        max_queue: batches waiting for the sender thread before new ones are dropped.
        data_parallel_rank: stamped on every batch.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = DEFAULT_TOPIC,
        buffer_steps: int = 10_000,
        max_queue: int = 100_000,
        data_parallel_rank: int | None = None,
    ) -> None:
        if buffer_steps <= 0 or max_queue <= 0:
            raise ValueError(f"buffer_steps and max_queue must be positive, got {buffer_steps}, {max_queue}")
        self._topic = topic.encode()
        self._dp_rank = data_parallel_rank
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(_bindable(endpoint))
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(_bindable(replay_endpoint))
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._next_seq = 0
        self.num_published = 0
        self.num_dropped = 0
        self.num_replay_requests = 0
        self.num_wakeups = 0
        """Times the sender thread woke up (a batch to send, a replay request, closing)."""
        self._closed = False
        # The sender thread sleeps in poll() until a batch is queued (the doorbell) or a replay
        # request arrives: an idle engine's publisher costs no wake-ups.
        self._doorbell_r, self._doorbell_w = os.pipe()
        os.set_blocking(self._doorbell_w, False)
        self._thread = threading.Thread(target=self._run, name="kvmesh-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue ``events`` as one batch; drops (and counts) it when the queue is full."""
        if self._closed or not events:
            return
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), list(events), self._dp_rank))
        except queue.Full:
            self.num_dropped += 1
            return
        self._ring()

    def _ring(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            # a full pipe already holds a wake-up the thread has not consumed yet
            os.write(self._doorbell_w, b"\0")

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (waiting at most ``timeout``), then close the sockets."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_SENTINEL, timeout=timeout)
        except queue.Full:
            pass
        self._ring()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            os.close(self._doorbell_r)
        os.close(self._doorbell_w)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._doorbell_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            self.num_wakeups += 1
            if self._doorbell_r in ready:
                # emptied before the queue: a batch queued after this read rings again
                os.read(self._doorbell_r, 4096)
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _SENTINEL:
                    return
                assert isinstance(item, KVEventBatch), f"unexpected queue item {type(item).__name__}"
                self._send(item)
            if self._replay is not None and self._replay in ready:
                self._serve_replay()

    def _send(self, batch: KVEventBatch) -> None:
        payload = encode_batch(batch.events, batch.ts, batch.data_parallel_rank)
        seq = self._next_seq
        self._next_seq += 1
        seq_bytes = seq.to_bytes(8, "big")
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq_bytes, payload), copy=False)
        self.num_published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.num_replay_requests += 1
            # [identity, b"", start] from a DEALER; [identity, start] from a client without the
            # empty delimiter frame is accepted too. A bad start gets just the end marker.
            identity, start_bytes = frames[0], frames[-1]
            if len(frames) >= 2 and len(start_bytes) == 8:
                start = int.from_bytes(start_bytes, "big")
                for seq, payload in self._buffer:
                    if seq >= start:
                        self._replay.send_multipart(
                            (identity, b"", self._topic, seq.to_bytes(8, "big"), payload), copy=False
                        )
            self._replay.send_multipart((identity, b"", b"", END_OF_REPLAY, b""))


@dataclass(slots=True)
class SubscriberStats:
    """Counters of a subscriber, summed over its publishers."""

    num_batches: int = 0
    num_events: int = 0
    num_malformed: int = 0
    num_gaps: int = 0
    num_replayed: int = 0
    num_lost: int = 0
    num_resets: int = 0


@dataclass(slots=True)
class _PublisherState:
    pod: PodId
    endpoint: str
    replay_endpoint: str | None
    socket: zmq.asyncio.Socket
    last_seq: int | None = None
    task: asyncio.Task[None] | None = None
    replay_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    recent: dict[int, int] = field(default_factory=dict)
    """seq → payload digest of recently delivered batches, to tell a duplicate from a restart."""
    recent_order: deque[int] = field(default_factory=deque)

    def remember(self, seq: int, payload: bytes) -> None:
        self.recent[seq] = xxhash.xxh3_64_intdigest(payload)
        self.recent_order.append(seq)
        if len(self.recent_order) > _RECENT_SEQS:
            self.recent.pop(self.recent_order.popleft(), None)

    def is_duplicate(self, seq: int, payload: bytes) -> bool:
        digest = self.recent.get(seq)
        return digest is not None and digest == xxhash.xxh3_64_intdigest(payload)

    def forget(self) -> None:
        self.recent.clear()
        self.recent_order.clear()


_RECENT_SEQS = 4096
_YIELD_EVERY = 64
"""Messages received back to back before the receive loop lets other tasks run."""


BatchHandler = Callable[[PodId, int, KVEventBatch], None]
ResetHandler = Callable[[PodId], None]


class ZmqEventSubscriber:
    """Receives KV event batches from many publishers on the running asyncio loop.

    Args:
        on_batch: called with (pod, seq, batch) for every batch, in seq order per pod.
        on_reset: called when a pod's publisher restarted (seq went backwards).
        topic: subscription prefix; empty takes every topic.
        replay_timeout: seconds to wait for a replay answer.
    """

    def __init__(
        self,
        on_batch: BatchHandler,
        on_reset: ResetHandler | None = None,
        *,
        topic: str = "",
        replay_timeout: float = 1.0,
    ) -> None:
        self._on_batch = on_batch
        self._on_reset = on_reset
        self._topic = topic.encode()
        self._replay_timeout = replay_timeout
        self._ctx = zmq.asyncio.Context()
        self._publishers: dict[PodId, _PublisherState] = {}
        self._running = False
        self._closed = asyncio.Event()
        self.stats = SubscriberStats()

    @property
    def pods(self) -> list[PodId]:
        return list(self._publishers)

    def last_seq(self, pod: PodId) -> int | None:
        """The last seq delivered for ``pod`` (``None`` before its first batch)."""
        state = self._publishers.get(pod)
        return None if state is None else state.last_seq

    def add_publisher(self, pod: PodId, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Start receiving from ``endpoint``; with a replay endpoint, first fetch its buffered history."""
        if pod in self._publishers:
            self.remove_publisher(pod)
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        sock.connect(endpoint)
        state = _PublisherState(pod, endpoint, replay_endpoint, sock)
        self._publishers[pod] = state
        if self._running:
            state.task = asyncio.get_running_loop().create_task(self._receive(state))

    def remove_publisher(self, pod: PodId) -> None:
        """Stop receiving from ``pod``."""
        state = self._publishers.pop(pod, None)
        if state is None:
            return
        if state.task is not None:
            state.task.cancel()
        state.socket.close(linger=0)

    async def run(self) -> None:
        """Receive until :meth:`aclose`."""
        self._running = True
        loop = asyncio.get_running_loop()
        for state in self._publishers.values():
            if state.task is None:
                state.task = loop.create_task(self._receive(state))
        await self._closed.wait()

    async def aclose(self) -> None:
        """Stop every receive task and close the sockets."""
        self._running = False
        for pod in list(self._publishers):
            self.remove_publisher(pod)
        self._closed.set()
        await asyncio.sleep(0)
        self._ctx.term()

    async def _receive(self, state: _PublisherState) -> None:
        if state.replay_endpoint:
            await self._replay_into(state, 0, None)
        # The same socket without asyncio's wrapper: what is already queued is taken by direct
        # non-blocking reads, not one future per message (which cost more than applying a decode
        # step's events).
        queued: zmq.Socket[bytes] = zmq.Socket.shadow(state.socket.underlying)
        while True:
            try:
                frames = await state.socket.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                logger.warning("event socket of %s failed: %s", state.pod, exc)
                return
            await self.handle_frames(state.pod, frames)
            for _ in range(_YIELD_EVERY):
                try:
                    frames = queued.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    logger.warning("event socket of %s failed: %s", state.pod, exc)
                    return
                await self.handle_frames(state.pod, frames)
            else:
                # Under a flood the reads never wait: hand the event loop to everything else.
                await asyncio.sleep(0)

    async def handle_frames(self, pod: PodId, frames: list[bytes]) -> None:
        """Process one received multipart message from ``pod`` (public for fuzzing and tests)."""
        state = self._publishers.get(pod)
        if state is None:
            return
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.num_malformed += 1
            return
        seq = int.from_bytes(frames[1], "big")
        last = state.last_seq
        if last is not None and seq <= last:
            if state.is_duplicate(seq, frames[2]):
                # Already delivered through a replay that overlapped the live stream.
                return
            # The publisher restarted: everything it announced before is gone.
            self.stats.num_resets += 1
            state.last_seq = None
            state.forget()
            if self._on_reset is not None:
                self._on_reset(pod)
            if seq > 0 and state.replay_endpoint:
                await self._replay_into(state, 0, seq)
        elif last is not None and seq > last + 1:
            self.stats.num_gaps += 1
            if state.replay_endpoint:
                await self._replay_into(state, last + 1, seq)
            missing = seq - 1 - (state.last_seq if state.last_seq is not None else last)
            if missing > 0:
                self.stats.num_lost += missing
        self._deliver(state, seq, frames[2])

    def _deliver(self, state: _PublisherState, seq: int, payload: bytes) -> None:
        if state.last_seq is not None and seq <= state.last_seq:
            return
        state.last_seq = seq
        state.remember(seq, payload)
        try:
            batch = decode_batch(payload)
        except ProtocolError:
            self.stats.num_malformed += 1
            return
        self.stats.num_batches += 1
        self.stats.num_events += len(batch.events)
        self._on_batch(state.pod, seq, batch)

    async def _replay_into(self, state: _PublisherState, start: int, stop: int | None) -> None:
        """Fetch batches ``start <= seq < stop`` from the pod's replay socket and deliver them."""
        assert state.replay_endpoint is not None
        async with state.replay_lock:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(state.replay_endpoint)
                await sock.send_multipart((b"", start.to_bytes(8, "big")))
                deadline = time.monotonic() + self._replay_timeout
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not await sock.poll(int(remaining * 1000)):
                        logger.warning("replay from %s timed out", state.pod)
                        return
                    frames = await sock.recv_multipart()
                    reply = _parse_replay_reply(frames)
                    if reply is None:
                        self.stats.num_malformed += 1
                        continue
                    seq_bytes, payload = reply
                    if seq_bytes == END_OF_REPLAY:
                        return
                    seq = int.from_bytes(seq_bytes, "big")
                    if stop is not None and seq >= stop:
                        continue
                    self.stats.num_replayed += 1
                    self._deliver(state, seq, payload)
            except zmq.ZMQError as exc:
                logger.warning("replay from %s failed: %s", state.pod, exc)
            finally:
                sock.close(linger=0)


def _parse_replay_reply(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """``(seq, payload)`` of one replay reply as a DEALER receives it, or ``None`` when malformed.

    Four frames ``[b"", topic, seq, payload]`` (vLLM's current form; the end marker is
    ``[b"", b"", END, b""]``) or three frames ``[b"", seq, payload]`` (older publishers; end marker
    ``[b"", END, b""]``). The end marker comes back with ``seq == END_OF_REPLAY``. The topic is not
    checked: the replay socket belongs to one publisher and answers only the requesting client.
    """
    if len(frames) == 4:
        delimiter, _topic, seq, payload = frames
    elif len(frames) == 3:
        delimiter, seq, payload = frames
    else:
        return None
    if delimiter or len(seq) != 8:
        return None
    if seq == END_OF_REPLAY and payload:
        return None
    return seq, payload
