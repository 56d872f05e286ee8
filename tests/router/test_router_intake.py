"""EventIntake over real ZMQ sockets: live events, replay on (re)subscribe, publisher restarts."""

from __future__ import annotations

import asyncio
import time

from kvmesh.core.event_transport import ZmqEventPublisher
from kvmesh.core.events import AllBlocksCleared, BlockStored
from kvmesh.core.hashing import BlockHasher, Namespace
from kvmesh.core.types import PodId
from kvmesh.router.index import InMemoryIndex
from kvmesh.router.ingest import EventApplier
from kvmesh.router.intake import EventIntake
from kvmesh.router.prefix import match_prefix

POD = PodId("http://127.0.0.1:1")
TOKENS = list(range(16 * 4))
HASHER = BlockHasher(Namespace("m"), 16)


async def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def held(idx: InMemoryIndex) -> int:
    return match_prefix(idx, HASHER, TOKENS).hit_tokens(POD)


async def test_live_events_reach_the_index_and_replay_rebuilds_a_new_router():
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    try:
        pub.publish([BlockStored([1, 2], None, TOKENS[:32], 16)])
        idx = InMemoryIndex()
        lags: list[float] = []
        intake = EventIntake(EventApplier(idx, model="m"), on_lag=lags.append)
        intake.add_pod(POD, pub.endpoint, pub.replay_endpoint)
        intake.start()
        # the batch published before we subscribed arrives through replay
        await wait_for(lambda: held(idx) == 32)
        await asyncio.sleep(0.2)  # let the SUB connection settle before publishing live
        pub.publish([BlockStored([3, 4], 2, TOKENS[32:64], 16)])
        await wait_for(lambda: held(idx) == 64)
        await intake.aclose()
        # one lag per applied batch: publication (the batch's wall-clock ts) to application
        assert len(lags) == 2 and all(0.0 <= lag < 5.0 for lag in lags)

        # a restarted router (fresh index) rebuilds everything from replay
        idx2 = InMemoryIndex()
        intake2 = EventIntake(EventApplier(idx2, model="m"))
        intake2.add_pod(POD, pub.endpoint, pub.replay_endpoint)
        intake2.start()
        await wait_for(lambda: held(idx2) == 64)
        assert intake2.subscriber.stats.num_replayed == 2
        await intake2.aclose()
    finally:
        pub.close()


async def test_publisher_restart_drops_the_pods_blocks():
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    idx = InMemoryIndex()
    intake = EventIntake(EventApplier(idx, model="m"))
    intake.add_pod(POD, endpoint, replay)
    intake.start()
    try:
        await asyncio.sleep(0.2)
        for i in range(3):
            pub.publish([BlockStored([10 + i], None if i == 0 else 9 + i, TOKENS[16 * i : 16 * (i + 1)], 16)])
        await wait_for(lambda: held(idx) == 48)
        pub.close()
        # same addresses, new process: seq starts again at 0 with a shorter history
        pub = ZmqEventPublisher(endpoint, replay)
        await asyncio.sleep(0.3)
        pub.publish([BlockStored([20], None, TOKENS[:16], 16)])
        await wait_for(lambda: intake.subscriber.stats.num_resets == 1)
        await wait_for(lambda: held(idx) == 16)
        pub.publish([AllBlocksCleared()])
        await wait_for(lambda: held(idx) == 0)
    finally:
        await intake.aclose()
        pub.close()


async def test_publisher_restart_drops_the_shared_tier_blocks_it_alone_announced():
    """A vLLM server's secondary tier announces its chunks as REMOTE storage: the router credits
    them to every pod, and the server's restart (seq reset) takes them back out."""
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    idx = InMemoryIndex()
    intake = EventIntake(EventApplier(idx, model="m"))
    intake.add_pod(POD, endpoint, replay)
    intake.start()
    other = PodId("http://127.0.0.1:2")

    def shared_tokens() -> int:
        return match_prefix(idx, HASHER, TOKENS).hit_tokens(other)

    try:
        await asyncio.sleep(0.2)
        pub.publish([BlockStored([10, 11], None, TOKENS[:32], 16)])
        pub.publish([BlockStored([10, 11], None, TOKENS[:32], 16, medium="STORAGE", locality="REMOTE")])
        await wait_for(lambda: shared_tokens() == 32)
        pub.close()
        pub = ZmqEventPublisher(endpoint, replay)
        await asyncio.sleep(0.3)
        pub.publish([BlockStored([20], None, TOKENS[:16], 16)])
        await wait_for(lambda: intake.subscriber.stats.num_resets == 1)
        await wait_for(lambda: held(idx) == 16)
        assert shared_tokens() == 0
    finally:
        await intake.aclose()
        pub.close()


async def test_remove_pod_forgets_blocks():
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    idx = InMemoryIndex()
    intake = EventIntake(EventApplier(idx, model="m"))
    try:
        pub.publish([BlockStored([1], None, TOKENS[:16], 16)])
        intake.add_pod(POD, pub.endpoint, pub.replay_endpoint)
        intake.add_pod(POD, pub.endpoint, pub.replay_endpoint)  # same endpoints: no-op
        intake.start()
        await wait_for(lambda: held(idx) == 16)
        intake.remove_pod(POD)
        assert held(idx) == 0
        assert intake.sources == {}
    finally:
        await intake.aclose()
        pub.close()
