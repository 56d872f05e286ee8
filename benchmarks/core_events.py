"""End-to-end KV event throughput over loopback ZMQ: publisher → subscriber → decoded events.

Batches of 64 BlockStored events (16 tokens each), as an engine emits them under load.

    python -m benchmarks.core_events [--json] [--batches N]
    python -m benchmarks.core_events --decode [--json]   # decode_batch alone, per wire form, best of 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import msgspec
import zmq

from kvmesh.core.event_transport import ZmqEventSubscriber
from kvmesh.core.events import BlockStored, KVEventBatch, decode_batch, encode_batch
from kvmesh.core.types import PodId


async def run(num_batches: int, events_per_batch: int) -> dict[str, float]:
    # Payloads are encoded up front and sent from a plain PUB socket so the figure measures the
    # receiving side (the router's concern): frames → seq tracking → decode → callback.
    payloads = [
        encode_batch(
            [
                BlockStored([b * events_per_batch + i], None, list(range(16)), 16, None, "GPU")
                for i in range(events_per_batch)
            ]
        )
        for b in range(64)
    ]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    received = 0
    done = asyncio.Event()

    def on_batch(pod: PodId, seq: int, batch: KVEventBatch) -> None:
        nonlocal received
        received += len(batch.events)
        if received >= num_batches * events_per_batch:
            done.set()

    sub = ZmqEventSubscriber(on_batch)
    sub.add_publisher(PodId("bench"), f"tcp://127.0.0.1:{port}")
    task = asyncio.create_task(sub.run())
    await asyncio.sleep(0.3)

    def send_all() -> None:
        for seq in range(num_batches):
            pub.send_multipart((b"kv-events", seq.to_bytes(8, "big"), payloads[seq % 64]))

    t0 = time.perf_counter()
    sender = asyncio.get_running_loop().run_in_executor(None, send_all)
    await asyncio.wait_for(done.wait(), 120)
    elapsed = time.perf_counter() - t0
    await sender
    await sub.aclose()
    await task
    pub.close(0)
    ctx.term()
    return {
        "events": received,
        "seconds": elapsed,
        "events_per_s": received / elapsed,
        "lost": sub.stats.num_lost,
    }


def decode_forms(events_per_batch: int) -> dict[str, bytes]:
    """One batch in each wire form ``decode_batch`` accepts, fastest path first."""
    events = [
        BlockStored([i], None, list(range(16)), 16, None, "GPU", session_id="s")
        for i in range(events_per_batch)
    ]
    fields = BlockStored.__struct_fields__
    as_maps = [{"type": "BlockStored", **{f: getattr(e, f) for f in fields}} for e in events]
    return {
        "vllm_map_events": encode_batch(events, ts=1.0),
        "positional_events": msgspec.msgpack.encode(
            [1.0, [["BlockStored", *(getattr(e, f) for f in fields)] for e in events], None]
        ),
        "map_batch": msgspec.msgpack.encode({"ts": 1.0, "events": as_maps, "data_parallel_rank": None}),
        "lenient_maps": msgspec.msgpack.encode(
            [1.0, [{"type": "BlockStored", "block_hashes": [e.block_hashes[0]]} for e in events]]
        ),
    }


def run_decode(events_per_batch: int, rounds: int = 2_000) -> dict[str, float]:
    """Events per second ``decode_batch`` turns out for each wire form (best of 5 runs)."""
    result = {}
    for form, payload in decode_forms(events_per_batch).items():
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(rounds):
                decode_batch(payload)
            best = min(best, time.perf_counter() - t0)
        result[form] = rounds * events_per_batch / best
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--events-per-batch", type=int, default=64)
    parser.add_argument("--decode", action="store_true", help="time decode_batch alone, per wire form")
    args = parser.parse_args()
    if args.decode:
        rates = run_decode(args.events_per_batch)
        if args.json:
            print(json.dumps(rates, indent=2))
        else:
            for form, rate in rates.items():
                print(f"{form:>18}: {rate / 1e6:.2f} M events/s")
        return
    result = asyncio.run(run(args.batches, args.events_per_batch))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{result['events']} events in {result['seconds']:.2f} s = {result['events_per_s'] / 1e3:.0f}k events/s "
            f"(batches of {args.events_per_batch}, lost {result['lost']})"
        )


if __name__ == "__main__":
    main()
