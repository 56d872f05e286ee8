"""Split event ingestion: each pod's events applied by one worker, its index writes sent to the
others over real ZMQ (ipc) sockets; every worker ends with the index one applier of every event
would build."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.core.events import BlockRemoved, BlockStored, KVEventBatch
from kvmesh.core.hashing import HashAlgo
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.router.index import SHARED_TIER_HOLDER, InMemoryIndex, MediumSet
from kvmesh.router.ingest import EventApplier
from kvmesh.router.ingest_split import IngestSplit, SplitIngest, ingest_owner
from kvmesh.router.split_shared import SharedHolderKeys
from kvmesh.router.split_wire import IndexOp, IndexOps, OpKind, decode_ops, encode_ops, split_keys

MODEL = "m"
BLOCK = 16
SHARED = Medium.SHARED.value


def _pods_owned_by(worker: int, num_workers: int, n: int) -> list[PodId]:
    out, i = [], 0
    while len(out) < n:
        pod = PodId(f"http://10.0.0.{i}:8000")
        if ingest_owner(pod, num_workers) == worker:
            out.append(pod)
        i += 1
    return out


POD_0, POD_0B = _pods_owned_by(0, 2, 2)
(POD_1,) = _pods_owned_by(1, 2, 1)
PODS = [POD_0, POD_0B, POD_1]


class Worker:
    """One router worker's ingestion, wired as the gateway wires it."""

    def __init__(self, directory: Path, worker: int, num_workers: int = 2) -> None:
        self.index = InMemoryIndex()
        self.owned: set[PodId] = set()
        self.split = SplitIngest(
            IngestSplit(worker, num_workers, str(directory)),
            self.index,
            held=self.index.held_by,
            owned_pods=lambda: self.owned,
            block_sizes=lambda: self.applier.pod_block_sizes(),
            on_block_size=lambda pod, size: self.applier.note_peer_block_size(pod, size),
        )
        self.applier = EventApplier(self.split, model=MODEL, algo=HashAlgo.XXH3)

    def take(self, pod: PodId) -> None:
        assert self.split.split.owns(pod)
        self.owned.add(pod)
        self.split.pod_added(pod)

    def view(self) -> dict[tuple[PodId, MediumSet], set[BlockKey]]:
        return {k: set(v) for k, v in self.index.held_by({*PODS, SHARED_TIER_HOLDER}).items()}


def _reference(batches: list[tuple[PodId, KVEventBatch]]) -> dict[tuple[PodId, MediumSet], set[BlockKey]]:
    index = InMemoryIndex()
    applier = EventApplier(index, model=MODEL, algo=HashAlgo.XXH3)
    for pod, batch in batches:
        applier.apply_batch(pod, batch)
    return {k: set(v) for k, v in index.held_by({*PODS, SHARED_TIER_HOLDER}).items()}


def _stream(n: int, seed: int = 0) -> list[tuple[PodId, KVEventBatch]]:
    """Chains stored and continued on every pod, some evicted, some written to the shared tier."""
    rng = random.Random(seed)
    live: dict[PodId, list[int]] = {p: [] for p in PODS}
    out: list[tuple[PodId, KVEventBatch]] = []
    next_hash = 1
    for _ in range(n):
        pod = rng.choice(PODS)
        tokens = [rng.randrange(30_000) for _ in range(4 * BLOCK)]
        hashes = list(range(next_hash, next_hash + 4))
        next_hash += 4
        events: list[object] = [BlockStored(hashes[:2], None, tokens[: 2 * BLOCK], BLOCK)]
        events.append(BlockStored(hashes[2:], hashes[1], tokens[2 * BLOCK :], BLOCK))
        live[pod].extend(hashes)
        if rng.random() < 0.3:
            events.append(BlockStored(hashes[:2], None, [], BLOCK, medium=SHARED))
        if len(live[pod]) > 24:
            gone, live[pod] = live[pod][:4], live[pod][4:]
            events.append(BlockRemoved(gone))
        out.append((pod, KVEventBatch(0.0, events)))  # type: ignore[arg-type]
    return out


async def _until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _feed(workers: list[Worker], batches: list[tuple[PodId, KVEventBatch]]) -> None:
    for pod, batch in batches:
        owner = ingest_owner(pod, len(workers))
        workers[owner].applier.apply_batch(pod, batch)


async def _started(tmp_path: Path, n: int = 2) -> list[Worker]:
    workers = [Worker(tmp_path, i, n) for i in range(n)]
    for w in workers:
        w.split.start()
    for pod in PODS:
        workers[ingest_owner(pod, n)].take(pod)
    # each worker's subscription reaches the other's XPUB, which answers with a snapshot
    await _until(lambda: all(w.split.link_stats.num_messages_received >= 1 for w in workers), "the peers")
    return workers


async def _closed(workers: list[Worker]) -> None:
    for w in workers:
        await w.split.aclose()


async def test_every_worker_ends_with_the_index_one_applier_builds(tmp_path: Path) -> None:
    workers = await _started(tmp_path)
    try:
        stream = _stream(300)
        _feed(workers, stream)
        want = _reference(stream)
        assert any(pod == SHARED_TIER_HOLDER for pod, _ in want), "the stream writes to the shared tier"
        await _until(lambda: all(w.view() == want for w in workers), "both indexes to match")
        # each worker applied only its own pods' events
        assert workers[0].applier.stats.num_events + workers[1].applier.stats.num_events == sum(
            len(b.events) for _, b in stream
        )
        assert workers[1].applier.num_blocks(POD_0) == 0 and workers[0].applier.num_blocks(POD_1) == 0
        assert all(w.split.link_stats.num_gaps == 0 for w in workers)
        # a peer's pod's engine block size reaches the worker that does not ingest it
        await _until(lambda: workers[0].applier.pod_block_size(POD_1) == BLOCK, "the block size")
    finally:
        await _closed(workers)


async def test_a_restarted_publisher_is_cleared_in_every_worker(tmp_path: Path) -> None:
    workers = await _started(tmp_path)
    try:
        stream = _stream(60, seed=1)
        _feed(workers, stream)
        await _until(lambda: workers[0].view() == workers[1].view() == _reference(stream), "the first stream")
        workers[1].applier.publisher_restarted(POD_1)
        await _until(
            lambda: not any(pod == POD_1 for w in workers for pod, _ in w.view()), "POD_1 cleared everywhere"
        )
        assert any(pod == POD_0 for pod, _ in workers[1].view()), "the other pods stay"
    finally:
        await _closed(workers)


async def test_a_late_worker_gets_a_snapshot_of_what_it_missed(tmp_path: Path) -> None:
    first = Worker(tmp_path, 0)
    first.split.start()
    for pod in (POD_0, POD_0B):
        first.take(pod)
    stream = [(p, b) for p, b in _stream(200, seed=2) if p != POD_1]
    _feed([first, first], stream)  # both owners are worker 0 here
    await asyncio.sleep(0.05)  # written and sent to nobody
    late = Worker(tmp_path, 1)
    late.split.start()
    try:
        want = _reference(stream)
        await _until(lambda: late.view() == want, "the late worker's snapshot")
        assert first.split.link_stats.num_snapshots_sent >= 1
    finally:
        await _closed([first, late])


async def test_a_gap_in_a_peers_messages_asks_for_a_snapshot(tmp_path: Path) -> None:
    workers = await _started(tmp_path)
    try:
        stream = _stream(100, seed=3)
        owner = workers[0].split
        _feed(workers, stream[:50])
        await _until(lambda: workers[1].view() == _reference(stream[:50]), "the first half")
        pub, owner._pub = owner._pub, None
        _feed(workers, stream[50:])
        owner.flush()  # these writes are lost on the way...
        owner._pub = pub
        owner._seq += 3  # ...and so are their sequence numbers
        extra = [(POD_0, KVEventBatch(0.0, [BlockStored([999_001], None, list(range(BLOCK)), BLOCK)]))]
        _feed(workers, extra)
        want = _reference(stream + extra)
        await _until(lambda: workers[1].view() == want, "the peer's resync")
        assert workers[1].split.link_stats.num_gaps >= 1
        assert owner.link_stats.num_snapshots_sent >= 2  # the first subscription's, then the resync's
    finally:
        await _closed(workers)


def test_shared_keys_leave_when_the_last_worker_that_announced_them_removes_them() -> None:
    index = InMemoryIndex()
    shared = SharedHolderKeys(index)
    keys = [BlockKey(bytes([i]) * 16) for i in range(3)]
    media = MediumSet(1 << 3)
    shared.add(0, keys, media)
    shared.add(1, keys[:1], media)
    assert shared.remove(0, keys, media) == 2  # keys[0] is still announced by worker 1
    assert [len(h) for h in index.lookup(keys[:1])] == [1]
    assert index.lookup(keys[1:2]) == []
    assert shared.clear(1) == 1
    assert index.lookup(keys[:1]) == []
    assert shared.remove(0, keys, media) == 0, "nothing left to remove"


def test_split_keys_round_trips_and_rejects_a_torn_blob() -> None:
    keys = [BlockKey(bytes([i]) * 16) for i in range(5)]
    assert split_keys(b"".join(keys)) == keys
    with pytest.raises(ValueError, match="whole number"):
        split_keys(b"x" * 17)


def test_ownership_is_stable_and_spreads_pods() -> None:
    pods = [PodId(f"http://10.1.0.{i}:8000") for i in range(64)]
    owners = [ingest_owner(p, 4) for p in pods]
    assert owners == [ingest_owner(p, 4) for p in pods]
    assert set(owners) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="not one of"):
        IngestSplit(2, 2, "/tmp")


async def test_a_malformed_message_is_counted_and_skipped(tmp_path: Path) -> None:
    workers = await _started(tmp_path)
    try:
        before = workers[1].split.link_stats.num_malformed
        pub = workers[0].split._pub
        assert pub is not None
        await pub.send(b"\x93not msgpack at all")
        torn = IndexOps(0, workers[0].split.incarnation, 0, [IndexOp(OpKind.ADD, POD_0, 1, b"x" * 17)])
        await pub.send(msgspec.msgpack.encode(torn))
        await _until(lambda: workers[1].split.link_stats.num_malformed == before + 2, "two malformed")
        stream = _stream(20, seed=4)
        _feed(workers, stream)
        await _until(lambda: workers[1].view() == _reference(stream), "later writes still applied")
    finally:
        await _closed(workers)


async def test_a_worker_ignores_peer_writes_about_its_own_pods(tmp_path: Path) -> None:
    workers = await _started(tmp_path)
    try:
        stream = [(p, b) for p, b in _stream(30, seed=5) if p == POD_0]
        _feed(workers, stream)
        want = _reference(stream)
        await _until(lambda: workers[1].view() == want, "the first stream")
        # the peer forgets POD_0 (an endpoint it no longer sees): the owner keeps its blocks
        workers[1].applier.forget_pod(POD_0)
        await asyncio.sleep(0.1)
        assert workers[0].view() == want
        assert not any(pod == POD_0 for pod, _ in workers[1].view())
    finally:
        await _closed(workers)


_keys = st.lists(st.binary(min_size=16, max_size=16), max_size=8).map(lambda ks: b"".join(ks))
_ops = st.builds(
    IndexOp,
    kind=st.sampled_from(list(OpKind)).map(int),
    pod=st.text(max_size=40),
    arg=st.integers(0, 2**31),
    keys=_keys,
)


@given(
    origin=st.integers(0, 64),
    incarnation=st.integers(0, 2**63 - 1),
    seq=st.integers(0, 2**40),
    ops=st.lists(_ops, max_size=6),
)
def test_writes_round_trip_through_the_wire(
    origin: int, incarnation: int, seq: int, ops: list[IndexOp]
) -> None:
    message = IndexOps(origin, incarnation, seq, ops)
    back = decode_ops(encode_ops(message))
    assert back == message
    for op in back.ops:
        assert b"".join(split_keys(op.keys)) == op.keys
