"""Event ingestion across router workers: every worker ingesting every event against the events
split by pod (``kvmesh router --workers N --split-events``), side by side in one run.

    .venv/bin/python benchmarks/router_ingest_split.py [--workers 2] [--batches 4000] [--json]

The streams are ``router_index.py``'s (8 pods): prefill batches (two chained 16-block BlockStored
events, evictions once a pod holds 4,096 blocks) and the decode stream as vLLM 0.32 publishes it
(one-block stores, each after a one-block eviction once a pod is full). Each pod's batches are
published, already encoded, on a real ZMQ PUB socket before the workers start reading (so the
publisher's work does not share their cores); N worker processes receive them with the
router's own intake (``EventIntake`` → ``EventApplier`` → index with the cache report's seen-block
memory, the router's default), and with ``--split-events`` each takes only its pods and sends its
index writes to the others (``SplitIngest``, ZMQ over ipc). A worker is done when its index equals
the index one applier of every event builds (checked key by key at the end).

Reported: block events per second of one process applying the same payloads with no sockets
(``router_index.py``'s figure, for scale: this machine's speed moves from run to run) and, in the
same process, what applying the stream's index writes as a peer costs against ingesting it; then of the fleet, the stream's block events over the busiest
worker's CPU time (workers run on their own cores; their CPU time is what ingestion costs them,
whatever else the machine runs), each worker's CPU seconds, and the wall time from the first
publication until every worker was done. Each mode runs ``--rounds`` times; the best is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import multiprocessing.connection
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import xxhash
import zmq
from router_index import PODS, _ingest_rate, make_batches, make_decode_batches

from kvmesh.core.events import KVEventBatch, decode_batch, encode_batch
from kvmesh.core.hashing import HashAlgo
from kvmesh.core.types import PodId
from kvmesh.router.cache_explain import CacheReportConfig
from kvmesh.router.cache_memory import RememberingIndex, SeenBlocks
from kvmesh.router.gc_tuning import tune_for_serving
from kvmesh.router.index import SHARED_TIER_HOLDER, InMemoryIndex
from kvmesh.router.ingest import EventApplier
from kvmesh.router.ingest_split import IngestSplit, SplitIngest
from kvmesh.router.intake import EventIntake
from kvmesh.router.split_wire import IndexOps, decode_ops, encode_ops

MODEL = "bench-model"
ALGO = HashAlgo.XXH3


def _digest(index: InMemoryIndex) -> int:
    """What ``index`` holds, as one number that any process computes alike."""
    digest = xxhash.xxh3_64()
    for (pod, media), keys in sorted(index.held_by({*PODS, SHARED_TIER_HOLDER}).items()):
        digest.update(f"{pod}/{media};".encode())
        digest.update(b"".join(sorted(keys)))
    return digest.intdigest()


def _worker(
    worker: int,
    num_workers: int,
    sockets: str | None,
    publishers: dict[str, str],
    batches_per_pod: dict[str, int],
    want: int,
    conn: Any,
) -> None:
    async def body() -> None:
        index = InMemoryIndex()
        local: Any = RememberingIndex(index, SeenBlocks(CacheReportConfig().seen_blocks))
        split = None
        if sockets is not None:
            split = SplitIngest(
                IngestSplit(worker, num_workers, sockets, placed=tuple(PODS)),
                local,
                held=index.held_by,
                owned_pods=lambda: intake.sources,
                block_sizes=lambda: applier.pod_block_sizes(),
                on_block_size=lambda pod, size: applier.note_peer_block_size(pod, size),
            )
            local = split
        applier = EventApplier(local, model=MODEL, algo=ALGO)
        intake = EventIntake(applier)
        own_batches = 0
        for pod, endpoint in publishers.items():
            if split is None or split.split.owns(PodId(pod)):
                intake.add_pod(PodId(pod), endpoint)
                own_batches += batches_per_pod[pod]
        # CPU time up to the last write: each applied batch, peer message and send marks it.
        mark = [0.0]
        inside = [0.0]

        def marking(fn: Any) -> Any:
            def wrapped(*a: Any) -> Any:
                t0 = time.process_time()
                out = fn(*a)
                mark[0] = time.process_time()
                inside[0] += mark[0] - t0
                return out

            return wrapped

        applier.apply_batch = marking(applier.apply_batch)  # type: ignore[method-assign]
        if split is not None:
            split.apply = marking(split.apply)  # type: ignore[method-assign]
            split.flush = marking(split.flush)  # type: ignore[method-assign]
        if split is not None:
            split.start()
        await asyncio.sleep(1.0)  # subscriptions reach the publishers and the peers
        tune_for_serving()  # as a serving router worker does
        conn.send("ready")
        await asyncio.to_thread(conn.recv)  # the stream is queued in the event sockets by now
        start = time.process_time()
        intake.start()
        deadline = time.monotonic() + 120
        checks: list[tuple[float, float]] = []  # the completion checks' CPU, not ingestion's
        while True:
            await asyncio.sleep(0.05)
            if intake.subscriber.stats.num_batches < own_batches:
                continue
            t0 = time.process_time()
            done = _digest(index) == want
            checks.append((t0, time.process_time()))
            if done:
                break
            if time.monotonic() > deadline:
                conn.send({"error": "timed out", "keys": index.stats().num_keys})
                return
        cpu = mark[0] - start - sum(t1 - t0 for t0, t1 in checks if t1 <= mark[0])
        conn.send(
            {
                "cpu_s": cpu,
                "apply_cpu_s": inside[0],
                "thread_cpu_s": time.thread_time(),
                "gaps": intake.subscriber.stats.num_gaps,
                "events_applied": applier.stats.num_events,
                "split": None if split is None else vars(split.link_stats),
            }
        )
        await intake.aclose()
        if split is not None:
            await split.aclose()

    asyncio.run(body())


def peer_apply_share(batches: list[tuple[PodId, KVEventBatch]]) -> float:
    """In one process, no sockets: the CPU time a peer takes to apply the index writes of the whole
    stream, over the time their owner took to ingest it and write them (both with the seen-block
    memory, as the router runs)."""
    payloads = [(pod, encode_batch(b.events, ts=0.0)) for pod, b in batches]
    sent: list[bytes] = []

    def worker(index: InMemoryIndex, num_workers: int, me: int) -> SplitIngest:
        split = SplitIngest(
            IngestSplit(me, num_workers, "/nonexistent"),  # never started: no sockets
            RememberingIndex(index, SeenBlocks(CacheReportConfig().seen_blocks)),
            held=index.held_by,
            owned_pods=lambda: PODS,
            block_sizes=dict,
            on_block_size=lambda pod, size: None,
        )
        return split

    owner = worker(InMemoryIndex(), 1, 0)  # one worker owns every pod
    owner._send = lambda ops: sent.append(encode_ops(IndexOps(0, 1, len(sent) + 1, ops)))  # type: ignore[method-assign]
    applier = EventApplier(owner, model=MODEL, algo=ALGO)
    gc.collect()
    start = time.process_time()
    for pod, payload in payloads:
        applier.apply_batch(pod, decode_batch(payload))
        owner.flush()
    ingest = time.process_time() - start
    peer = worker(InMemoryIndex(), 2, 1)
    # worker 1 of 2 owning none of the pods (the split's cache of owners, set before any lookup)
    object.__setattr__(peer.split, "_owners", dict.fromkeys(PODS, 0))
    gc.collect()
    start = time.process_time()
    for message in sent:
        peer.apply(decode_ops(message))
    return (time.process_time() - start) / ingest


def _reference(batches: list[tuple[PodId, KVEventBatch]]) -> int:
    index = InMemoryIndex()
    applier = EventApplier(index, model=MODEL, algo=ALGO)
    for pod, batch in batches:
        applier.apply_batch(pod, batch)
    return _digest(index)


def _answer(pipe: Any, proc: Any, timeout: float = 180.0) -> Any:
    """A worker's next message, or an error when it died or went quiet."""
    deadline = time.monotonic() + timeout
    while not pipe.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"a worker exited with {proc.exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError("a worker did not answer")
    return pipe.recv()


def run_mode(
    batches: list[tuple[PodId, KVEventBatch]], n_events: int, num_workers: int, *, split: bool
) -> dict[str, Any]:
    ctx = zmq.Context()
    socks: dict[PodId, zmq.Socket[bytes]] = {}
    endpoints: dict[str, str] = {}
    for pod in PODS:
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        socks[pod] = sock
        endpoints[pod] = f"tcp://127.0.0.1:{port}"
    frames = [(pod, encode_batch(b.events, ts=0.0)) for pod, b in batches]
    per_pod = {pod: sum(1 for p, _ in batches if p == pod) for pod in PODS}
    want = _reference(batches)
    mp = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as sockets:
        pipes, procs = [], []
        for w in range(num_workers):
            here, there = mp.Pipe()
            proc = mp.Process(
                target=_worker,
                args=(w, num_workers, sockets if split else None, endpoints, per_pod, want, there),
            )
            proc.start()
            pipes.append(here)
            procs.append(proc)
        for p, proc in zip(pipes, procs, strict=True):
            assert _answer(p, proc) == "ready"
        seqs = dict.fromkeys(PODS, 0)
        for pod, payload in frames:
            socks[pod].send_multipart((b"", seqs[pod].to_bytes(8, "big"), payload))
            seqs[pod] += 1
        time.sleep(1.0)  # on their way into the workers' sockets, which they read from "go" on
        for p in pipes:
            p.send("go")
        began = time.monotonic()
        results = [_answer(p, proc) for p, proc in zip(pipes, procs, strict=True)]
        wall = time.monotonic() - began
        for proc in procs:
            proc.join(30)
    ctx.destroy(linger=0)
    errors = [r for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"a worker did not converge: {errors}")
    busiest = max(r["cpu_s"] for r in results)
    return {
        "workers": num_workers,
        "split": split,
        "events_per_s": n_events / busiest,
        "worker_cpu_s": [round(r["cpu_s"], 4) for r in results],
        "worker_apply_cpu_s": [round(r["apply_cpu_s"], 4) for r in results],
        "wall_s": wall,
        "gaps": sum(r["gaps"] for r in results),
        "events_applied": [r["events_applied"] for r in results],
        "split_stats": [r["split"] for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    parser.add_argument(
        "--batches", type=int, default=4000, help="prefill batches (the decode stream has 3x)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    streams = {
        "prefill": make_batches(args.batches, ALGO),
        "decode": make_decode_batches(3 * args.batches),
    }
    rows: list[dict[str, Any]] = []
    modes = [
        (n, split) for n in map(int, args.workers.split(",")) for split in (False, True) if n > 1 or not split
    ]
    for name, (batches, n_events) in streams.items():
        # The same stream applied in this process from its payloads, no sockets: router_index.py's figure.
        in_process = _ingest_rate(ALGO, batches, n_events, args.rounds, payloads=True, seen_blocks=True)
        rows.append(
            {
                "stream": name,
                "block_events": n_events,
                "workers": 0,
                "split": False,
                "events_per_s": in_process,
                "peer_apply_share": min(peer_apply_share(batches) for _ in range(args.rounds)),
            }
        )
        for num_workers, split in modes:
            best: dict[str, Any] | None = None
            for r in range(args.rounds):
                print(f"{name}: {num_workers} workers, split={split}, round {r + 1}", file=sys.stderr)
                row = run_mode(batches, n_events, num_workers, split=split)
                if best is None or row["events_per_s"] > best["events_per_s"]:
                    best = row
            assert best is not None
            rows.append({"stream": name, "block_events": n_events, **best})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        "| stream | workers | events split | block events/s (busiest worker's CPU) | worker CPU s | wall s |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        if row["workers"] == 0:
            print(
                f"| {row['stream']} | in process, no sockets (a peer's writes cost "
                f"{row['peer_apply_share']:.2f} of ingesting) | – | {row['events_per_s']:,.0f} | – | – |"
            )
            continue
        print(
            f"| {row['stream']} | {row['workers']} | {'yes' if row['split'] else 'no'} | "
            f"{row['events_per_s']:,.0f} | {' / '.join(f'{c:.3f}' for c in row['worker_cpu_s'])} | "
            f"{row['wall_s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
