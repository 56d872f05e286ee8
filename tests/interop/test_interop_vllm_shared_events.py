"""A live vLLM with KVMeshConnector over a store with a shared directory announces what its saves put
there: a SHARED BlockStored arrives on vLLM's own KV event socket, naming the blocks as vLLM's own
events do, and a kvmesh router ingesting that stream credits every other pod with those tokens."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from interop_helpers import LiveVllm, complete, stop, wait_healthy

from kvmesh.core.events import BlockStored, KVEventBatch, decode_batch
from kvmesh.core.net import free_ports
from kvmesh.core.types import PodId
from kvmesh.fleet.process import ManagedProcess
from kvmesh.fleet.vllm import VllmReplica
from kvmesh.router.index import InMemoryIndex
from kvmesh.router.ingest import EventApplier
from kvmesh.router.prefix import match_prefix

pytestmark = pytest.mark.slow

CHUNK = 256
"""The store's default chunk size."""
PROMPT = [(i * 7919) % 30000 + 1000 for i in range(600)]
"""Two whole store chunks and a partial one (token ids: no tokenizer in the way)."""
EVENT_WAIT_S = 120.0
"""How long the test waits for the announcement before failing (vLLM publishes only from its
step loop, so the test keeps sending one-token requests meanwhile)."""


class EventTap:
    """Every batch vLLM's KV event publisher sends, from the moment of connecting."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self.batches: list[KVEventBatch] = []

    def read(self, timeout_s: float) -> None:
        """Append the batches that arrive within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self._sock.poll(int(left * 1000)):
                return
            _topic, _seq, payload = self._sock.recv_multipart()
            self.batches.append(decode_batch(payload))

    def stored(self, medium: str) -> list[BlockStored]:
        return [
            e for b in self.batches for e in b.events if isinstance(e, BlockStored) and e.medium == medium
        ]

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.fixture(scope="module")
def vllm_fs(
    vllm_available: None, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveVllm, EventTap]]:
    """One vLLM whose connector's store is a RAM tier over a shared directory, with KV events."""
    run = tmp_path_factory.mktemp("vllm-fs")
    ports = free_ports(3)
    replica = VllmReplica(
        name="vllm-fs",
        port=ports[0],
        events_port=ports[1],
        replay_port=ports[2],
        model_dir=model_dir,
        store=f"file://{run / 'shared'}",
        cpu_core=0,
    )
    live = LiveVllm(
        replica, ManagedProcess(replica.name, replica.argv(), run / "vllm.log", env=replica.env())
    )
    live.proc.start()
    tap = None
    try:
        wait_healthy(live)
        assert replica.events_endpoint is not None
        tap = EventTap(replica.events_endpoint)
        tap.read(1.0)  # the subscription is in place before anything is published
        yield live, tap
    finally:
        if tap is not None:
            tap.close()
        stop(live.proc)


def wait_for_shared(live: LiveVllm, tap: EventTap) -> list[BlockStored]:
    """The SHARED events, once one has arrived (empty after :data:`EVENT_WAIT_S`)."""
    deadline = time.monotonic() + EVENT_WAIT_S
    while not tap.stored("SHARED") and time.monotonic() < deadline:
        tap.read(1.0)
        if not tap.stored("SHARED"):
            complete(live.url, [5, 6, 7], max_tokens=1)  # a step, whose output carries the events
    tap.read(0.5)
    return tap.stored("SHARED")


def gpu_chain(tap: EventTap, prompt: list[int]) -> tuple[BlockStored, list[Any], list[Any]]:
    """vLLM's own (GPU) events for ``prompt``: the first one, and the block hashes and extra keys
    of the chain it starts (chunked prefill may announce it in several events)."""
    events = tap.stored("GPU")
    first = next(
        e
        for e in events
        if e.parent_block_hash is None and e.token_ids and prompt[: len(e.token_ids)] == e.token_ids
    )
    hashes: list[Any] = []
    extra_keys: list[Any] = []
    event: BlockStored | None = first
    while event is not None:
        hashes += event.block_hashes
        extra_keys += event.extra_keys or [None] * len(event.block_hashes)
        event = next((e for e in events if e.parent_block_hash == hashes[-1]), None)
    return first, hashes, extra_keys


def test_a_write_to_the_shared_directory_is_announced_and_credited_to_every_pod(
    vllm_fs: tuple[LiveVllm, EventTap],
) -> None:
    live, tap = vllm_fs
    result = complete(live.url, PROMPT, max_tokens=4)
    assert result.prompt_tokens == len(PROMPT)
    shared = wait_for_shared(live, tap)
    assert shared, f"no SHARED BlockStored on vLLM's event socket:\n{live.proc.log_tail(30)}"
    (event,) = shared
    whole_chunks = len(PROMPT) // CHUNK * CHUNK

    assert event.medium == "SHARED"
    assert event.parent_block_hash is None
    assert event.token_ids == PROMPT[:whole_chunks]
    # vLLM's own events for those blocks name them the same way
    gpu, hashes, extra_keys = gpu_chain(tap, PROMPT)
    n = whole_chunks // gpu.block_size
    assert event.block_size == gpu.block_size
    assert event.block_hashes == hashes[:n]
    assert event.extra_keys == extra_keys[:n]
    assert (event.lora_id, event.lora_name) == (gpu.lora_id, gpu.lora_name)
    assert (event.group_idx, event.kv_cache_spec_kind) == (gpu.group_idx, gpu.kv_cache_spec_kind)

    # a router ingesting the stream credits the shared prefix to a pod that never saw it
    writer, other = PodId(live.url), PodId("http://127.0.0.1:1")
    applier = EventApplier(InMemoryIndex(), model="smollm2")
    for batch in tap.batches:
        applier.apply_batch(writer, batch)
    match = applier.align_match(match_prefix(applier.index, applier.hasher(), PROMPT))
    assert match.shared is not None
    assert match.shared.num_blocks * match.block_size == whole_chunks
    assert match.hit_tokens(other) == whole_chunks
    assert match.hit_tokens(writer) >= whole_chunks, "the writer keeps its own blocks"
