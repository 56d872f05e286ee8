"""Index writes applied by one background thread: order, batching, back-pressure, outages."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Sequence

import pytest

from kvmesh.core.events import BlockStored, KVEventBatch
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.errors import TierUnavailableError
from kvmesh.router.index import InMemoryIndex, medium_set
from kvmesh.router.ingest import EventApplier
from kvmesh.router.redis_index import RedisIndex
from kvmesh.router.write_behind import (
    AddBlocks,
    ClearPod,
    IndexWrite,
    RemoveBlocks,
    WriteBehindIndex,
    apply_writes,
)

GPU = medium_set(Medium.GPU)
A, B = PodId("http://a:1"), PodId("http://b:1")


def keys(n: int, tag: str = "k") -> list[BlockKey]:
    return [BlockKey(f"{tag}{i:015d}".encode()[:16]) for i in range(n)]


class GatedIndex(InMemoryIndex):
    """An in-memory index that records each batch and holds the writer until ``gate`` opens."""

    def __init__(self) -> None:
        super().__init__(None)
        self.batches: list[list[IndexWrite]] = []
        self.gate = threading.Event()
        self.entered = threading.Event()

    def write_batch(self, writes: Sequence[IndexWrite]) -> None:
        self.entered.set()
        assert self.gate.wait(5), "test never opened the gate"
        self.batches.append(list(writes))
        apply_writes(self, writes)


def test_nothing_is_written_before_start_and_queued_writes_keep_their_order():
    inner = GatedIndex()
    inner.gate.set()
    writer = WriteBehindIndex(inner)
    ks = keys(3)
    writer.add(ks, A, GPU)
    writer.remove(ks[2:], A)
    writer.clear_pod(B)
    writer.add([], A, GPU)  # empty writes are not queued
    assert inner.batches == [] and writer.num_pending == 3
    writer.start()
    assert writer.wait_written(5)
    assert inner.batches == [
        [AddBlocks(tuple(ks), A, GPU), RemoveBlocks((ks[2],), A, medium_set(*Medium)), ClearPod(B)]
    ]
    assert writer.lookup(ks) == [{A: GPU}, {A: GPU}]
    writer.close()


def test_a_busy_writer_never_blocks_the_caller_and_takes_the_backlog_in_one_batch():
    inner = GatedIndex()
    writer = WriteBehindIndex(inner)
    writer.start()
    first, rest = keys(1, "f"), keys(50, "r")
    writer.add(first, A, GPU)
    assert inner.entered.wait(5)  # the writer now sits inside the backend with the first write
    for key in rest:
        writer.add([key], B, GPU)  # returns at once although the backend is stuck
    assert writer.num_pending == 50
    inner.gate.set()
    assert writer.wait_written(5)
    assert [len(b) for b in inner.batches] == [1, 50]
    assert writer.lookup(rest) == [{B: GPU}] * 50
    writer.close()


def test_a_full_queue_drops_new_writes_and_counts_them():
    inner = GatedIndex()
    writer = WriteBehindIndex(inner, max_pending=4)
    for key in keys(6):
        writer.add([key], A, GPU)
    assert (writer.num_pending, writer.num_dropped) == (4, 2)
    inner.gate.set()
    writer.start()
    assert writer.wait_written(5)
    assert len(writer.lookup(keys(6))) == 4
    writer.close()


def test_close_applies_what_is_queued():
    inner = GatedIndex()
    inner.gate.set()
    writer = WriteBehindIndex(inner)
    writer.add(keys(2), A, GPU)
    writer.start()
    writer.close()
    assert inner.lookup(keys(2)) == [{A: GPU}] * 2


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_server_loses_batches_without_raising_into_the_caller():
    idx = RedisIndex(f"redis://127.0.0.1:{_closed_port()}/0")
    writer = WriteBehindIndex(idx)
    writer.start()
    writer.add(keys(2), A, GPU)
    writer.clear_pod(A)
    assert writer.wait_written(10)
    assert writer.num_failed_batches >= 1
    with pytest.raises(TierUnavailableError):
        writer.lookup(keys(1))
    writer.close()
    idx.close()


def test_redis_batches_mix_adds_removes_and_clears_like_single_calls(redis_url):
    prefix = f"wb{uuid.uuid4().hex[:8]}:"
    batched, single = (
        RedisIndex(redis_url, key_prefix=prefix + "b:"),
        RedisIndex(redis_url, key_prefix=prefix + "s:"),
    )
    ks = keys(4)
    writes: list[IndexWrite] = [
        AddBlocks(tuple(ks), A, GPU),
        AddBlocks(tuple(ks[:2]), B, GPU),
        RemoveBlocks(tuple(ks[1:3]), A, GPU),
        AddBlocks(tuple(ks[2:3]), A, GPU),  # removed then added again in the same run
        ClearPod(B),
        AddBlocks(tuple(ks[:1]), B, GPU),
    ]
    batched.write_batch(writes)
    apply_writes(single, writes)  # one call each
    for key in ks:
        assert batched.lookup([key]) == single.lookup([key])
    assert batched.lookup(ks) == [{A: GPU, B: GPU}]
    # membership sets agree too: clearing A drops the same entries from both
    assert batched.clear_pod(A) == single.clear_pod(A) == 3
    batched.close()
    single.close()


def test_applier_counts_a_background_drop_from_its_own_map():
    writer = WriteBehindIndex(InMemoryIndex())
    applier = EventApplier(writer, model="m", block_size=4)
    stored = BlockStored(
        block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=list(range(12)), block_size=4
    )
    applier.apply_batch(A, KVEventBatch(ts=0.0, events=[stored]))
    assert applier.drop_pod(A) == 3
    assert applier.drop_pod(A) == 0
    writer.start()
    assert writer.wait_written(5)
    assert writer.lookup(applier.hasher().hash_blocks(list(range(12)))) == []
    writer.close()
