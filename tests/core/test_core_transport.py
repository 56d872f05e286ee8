"""Real ZMQ sockets on loopback: replay, gaps, restarts."""

import asyncio
import subprocess
import sys
import textwrap

import pytest

from kvmesh.core.event_transport import ZmqEventPublisher, ZmqEventSubscriber
from kvmesh.core.events import BlockStored, KVEventBatch
from kvmesh.core.net import free_port
from kvmesh.core.types import PodId


def stored(i: int) -> BlockStored:
    return BlockStored([i], None, list(range(16)), 16, None, "GPU")


class Collector:
    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.hashes: list[int] = []
        self.resets = 0

    def on_batch(self, pod: PodId, seq: int, batch: KVEventBatch) -> None:
        self.seqs.append(seq)
        for ev in batch.events:
            assert isinstance(ev, BlockStored)
            self.hashes.append(ev.block_hashes[0])

    def on_reset(self, pod: PodId) -> None:
        self.resets += 1


async def wait_for(pred, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


class DroppingPublisher(ZmqEventPublisher):
    """Buffers every batch for replay but does not put seqs in ``drop`` on the wire."""

    drop: frozenset[int] = frozenset()

    def _send(self, batch: KVEventBatch) -> None:
        seq = self._next_seq
        if seq in self.drop:
            from kvmesh.core.events import encode_batch

            self._buffer.append((seq, encode_batch(batch.events, batch.ts, batch.data_parallel_rank)))
            self._next_seq += 1
            return
        super()._send(batch)


async def test_history_replayed_on_subscribe_then_live_stream_in_order():
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    col = Collector()
    sub = ZmqEventSubscriber(col.on_batch, col.on_reset)
    try:
        for i in range(3):
            pub.publish([stored(i)])
        await asyncio.sleep(0.1)
        sub.add_publisher(PodId("a"), pub.endpoint, pub.replay_endpoint)
        task = asyncio.create_task(sub.run())
        await wait_for(lambda: len(col.seqs) == 3)
        await asyncio.sleep(0.2)  # let the SUB connection settle before publishing live
        for i in range(3, 6):
            pub.publish([stored(i)])
        await wait_for(lambda: len(col.seqs) == 6)
        assert col.seqs == list(range(6)) and col.hashes == list(range(6))
        assert col.resets == 0 and sub.stats.num_replayed == 3
    finally:
        await sub.aclose()
        pub.close()
    await task


async def test_dropped_frames_are_recovered_through_replay():
    pub = DroppingPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    pub.drop = frozenset({3, 4, 5})
    col = Collector()
    sub = ZmqEventSubscriber(col.on_batch, col.on_reset)
    sub.add_publisher(PodId("a"), pub.endpoint, pub.replay_endpoint)
    task = asyncio.create_task(sub.run())
    try:
        await asyncio.sleep(0.3)
        for i in range(10):
            pub.publish([stored(i)])
        await wait_for(lambda: len(col.seqs) == 10)
        assert col.seqs == list(range(10))
        assert sub.stats.num_gaps == 1 and sub.stats.num_lost == 0
    finally:
        await sub.aclose()
        pub.close()
    await task


PUBLISHER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from kvmesh.core.event_transport import ZmqEventPublisher
    from kvmesh.core.events import BlockStored
    pub = ZmqEventPublisher(sys.argv[1], sys.argv[2])
    print("ready", flush=True)
    time.sleep(0.5)
    for i in range(int(sys.argv[3])):
        pub.publish([BlockStored([int(sys.argv[4]) + i], None, list(range(16)), 16)])
    time.sleep(60)
    """
)


def free_tcp_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def start_publisher(endpoint: str, replay: str, count: int, first: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER_SCRIPT, endpoint, replay, str(count), str(first)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.timeout(60)
async def test_killed_and_restarted_publisher_is_detected_as_reset():
    endpoint, replay = free_tcp_endpoint(), free_tcp_endpoint()
    col = Collector()
    sub = ZmqEventSubscriber(col.on_batch, col.on_reset)
    sub.add_publisher(PodId("a"), endpoint, replay)
    task = asyncio.create_task(sub.run())
    first = start_publisher(endpoint, replay, 5, 100)
    try:
        await wait_for(lambda: len(col.seqs) == 5, 10)
        first.kill()
        first.wait()
        second = start_publisher(endpoint, replay, 2, 200)
        try:
            await wait_for(lambda: col.resets == 1 and len(col.seqs) == 7, 10)
        finally:
            second.kill()
            second.wait()
        assert col.seqs == [0, 1, 2, 3, 4, 0, 1]
        assert col.hashes == [100, 101, 102, 103, 104, 200, 201]
        assert sub.stats.num_resets == 1
    finally:
        first.kill()
        await sub.aclose()
    await task


def test_publish_never_blocks_when_queue_is_full():
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", max_queue=1)
    try:
        for i in range(1000):
            pub.publish([stored(i)])
        assert pub.num_dropped + pub.num_published <= 1000
        assert pub.num_dropped > 0
    finally:
        pub.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        ZmqEventPublisher("tcp://127.0.0.1:0", buffer_steps=0)


END = (-1).to_bytes(8, "big", signed=True)
MALFORMED_REPLIES = [
    [b""],  # too few frames
    [b"", b"t", (0).to_bytes(8, "big"), b"p", b"extra"],  # too many frames
    [b"x", b"t", (0).to_bytes(8, "big"), b"p"],  # non-empty delimiter
    [b"", b"t", b"\x00" * 7, b"p"],  # short seq
    [b"", b"\x00" * 9, b"p"],  # long seq, three frames
    [b"", END, b"not-empty"],  # end marker with a payload
]


async def _serve_replay_by_hand(
    router, form: str, payloads: list[bytes], requests: list[list[bytes]]
) -> None:
    """Answer one replay request like an old (3-frame) or current vLLM (4-frame) publisher."""
    frames = await router.recv_multipart()
    requests.append(frames)
    identity, start = frames[0], int.from_bytes(frames[-1], "big")
    for bad in MALFORMED_REPLIES:
        await router.send_multipart([identity, *bad])
    for seq, payload in enumerate(payloads):
        if seq < start:
            continue
        seq_b = seq.to_bytes(8, "big")
        body = [b"", b"kv-events", seq_b, payload] if form == "four" else [b"", seq_b, payload]
        await router.send_multipart([identity, *body])
    end = [b"", b"", END, b""] if form == "four" else [b"", END, b""]
    await router.send_multipart([identity, *end])


@pytest.mark.parametrize("form", ["three", "four"])
async def test_subscriber_replays_from_old_and_current_reply_forms(form):
    import zmq
    import zmq.asyncio

    from kvmesh.core.events import encode_batch

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    router = ctx.socket(zmq.ROUTER)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    router_port = router.bind_to_random_port("tcp://127.0.0.1")
    payloads = [encode_batch([stored(i)], float(i)) for i in range(4)]
    requests: list[list[bytes]] = []
    col = Collector()
    sub = ZmqEventSubscriber(col.on_batch, col.on_reset)
    sub.add_publisher(PodId("a"), f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{router_port}")
    server = asyncio.create_task(_serve_replay_by_hand(router, form, payloads[:3], requests))
    task = asyncio.create_task(sub.run())
    try:
        await asyncio.wait_for(server, 5)
        await wait_for(lambda: len(col.seqs) == 3)
        assert requests == [[requests[0][0], b"", (0).to_bytes(8, "big")]]
        assert sub.stats.num_replayed == 3
        assert sub.stats.num_malformed == len(MALFORMED_REPLIES)
        # The live stream continues after the replayed history (resent until the SUB has joined;
        # repeats of the same seq and payload are dropped as duplicates).
        for _ in range(100):
            await pub.send_multipart([b"kv-events", (3).to_bytes(8, "big"), payloads[3]])
            if len(col.seqs) == 4:
                break
            await asyncio.sleep(0.05)
        assert col.seqs == [0, 1, 2, 3] and col.hashes == [0, 1, 2, 3]
        assert sub.stats.num_gaps == 0 and sub.stats.num_resets == 0 and sub.stats.num_lost == 0
    finally:
        await sub.aclose()
        await task
        pub.close(0)
        router.close(0)
        ctx.term()


def test_publisher_answers_replay_in_the_four_frame_form():
    import time

    import zmq

    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="my-topic")
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        for i in range(3):
            pub.publish([stored(i)])
        deadline = time.monotonic() + 5
        while pub.num_published < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.replay_endpoint is not None
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replies = [dealer.recv_multipart() for _ in range(3)]
        from kvmesh.core.events import decode_batch

        for seq, reply in zip((1, 2), replies, strict=False):
            assert len(reply) == 4 and reply[:3] == [b"", b"my-topic", seq.to_bytes(8, "big")]
            assert decode_batch(reply[3]).events == [stored(seq)]
        assert replies[2] == [b"", b"", END, b""]
        # A bad start seq gets just the end marker.
        dealer.send_multipart([b"", b"bad"])
        assert dealer.recv_multipart() == [b"", b"", END, b""]
        assert pub.num_replay_requests == 2
    finally:
        dealer.close(0)
        ctx.term()
        pub.close()


async def test_a_flood_of_queued_batches_leaves_the_event_loop_to_other_tasks():
    pub = ZmqEventPublisher("tcp://127.0.0.1:0")
    ticks = 0
    seen_at: list[int] = []
    sub = ZmqEventSubscriber(lambda pod, seq, batch: seen_at.append(ticks))
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    try:
        sub.add_publisher(PodId("a"), pub.endpoint)
        await asyncio.sleep(0.3)  # connected: what follows queues in the SUB socket
        for i in range(2000):
            pub.publish([stored(i)])
        await asyncio.sleep(0.5)
        tick_task = asyncio.create_task(ticker())
        task = asyncio.create_task(sub.run())
        await wait_for(lambda: len(seen_at) >= 1900)
        stop.set()
        await tick_task
        # Read back to back, 1900 queued batches would all be handled at one tick.
        assert len(set(seen_at)) >= 1900 // 64 // 2, len(set(seen_at))
    finally:
        await sub.aclose()
        pub.close()
    await task


async def test_an_idle_publisher_thread_sleeps_until_a_batch_or_a_replay_request():
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    col = Collector()
    sub = ZmqEventSubscriber(col.on_batch, col.on_reset)
    try:
        await asyncio.sleep(0.3)
        # a polling sender would have woken every few milliseconds by now
        assert pub.num_wakeups == 0
        sub.add_publisher(PodId("a"), pub.endpoint, pub.replay_endpoint)
        task = asyncio.create_task(sub.run())
        await wait_for(lambda: pub.num_replay_requests == 1)
        await asyncio.sleep(0.2)
        pub.publish([stored(7)])
        await wait_for(lambda: col.hashes == [7])
        await asyncio.sleep(0.3)
        # the replay request and the batch, each once or twice (a doorbell read racing a publish)
        assert 2 <= pub.num_wakeups <= 4
    finally:
        await sub.aclose()
        pub.close()
    await task
