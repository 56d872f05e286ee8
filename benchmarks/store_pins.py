"""What pins cost a Redis/Valkey server: one pin call, and the release every writer runs once a second.

Starts its own server (``volatile-lru``), writes ``N`` small chunks pinned by one tenant (in
batches of one prompt's worth of chunks), then times, per size: pinning one more 32-chunk prompt
(the budget check, the ledger update and ``PERSIST``; one Lua call), re-pinning it (extending), and
the release (:meth:`RedisPinLedger.release_expired`), which also walks the next slice of live pins
to give back ``PERSIST`` to any a concurrent ``SET … PX`` rewrote. Every call runs inside the
server, blocking it; the release runs once a second per writer, so it must not grow with ``N``.

    python -m benchmarks.store_pins [--json] [--flavor valkey] [--sizes 1000,10000,100000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from kvmesh.core.types import BlockKey
from kvmesh.store.backends.redis import RedisBackend
from kvmesh.store.keys import StoreKey
from kvmesh.store.local_server import LocalServer
from kvmesh.store.pins import PinRequest

GROUP = "00000000000000ab"
PROMPT_CHUNKS = 32
VALUE = b"x" * 64


def key(i: int) -> StoreKey:
    return StoreKey(GROUP, BlockKey(i.to_bytes(16, "big")))


async def _median_ms(call, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


async def _measure(flavor: str, sizes: list[int], repeats: int) -> list[dict[str, float]]:
    out = []
    with LocalServer(flavor, extra_args=["--maxmemory-policy", "volatile-lru"]) as server:
        backend = RedisBackend(server.url, ttl_s=3600, key_prefix="bench")
        try:
            pinned = 0
            for size in sizes:
                while pinned < size:
                    batch = [key(i) for i in range(pinned, min(size, pinned + 512))]
                    await backend.put_many([(k, VALUE) for k in batch])
                    outcome = await backend.pins.pin_many(PinRequest(batch, "acme", 3600.0, 1 << 40))
                    assert outcome.accepted, outcome
                    pinned += len(batch)
                extra = [key(10_000_000 + i) for i in range(PROMPT_CHUNKS)]
                await backend.put_many([(k, VALUE) for k in extra])
                first = time.perf_counter()
                await backend.pins.pin_many(PinRequest(extra, "acme", 3600.0, 1 << 40))
                pin_ms = (time.perf_counter() - first) * 1000
                repin_ms = await _median_ms(
                    lambda keys=extra: backend.pins.pin_many(PinRequest(keys, "acme", 3600.0, 1 << 40)),
                    repeats,
                )
                check_ms = await _median_ms(
                    lambda keys=extra: backend.pins.pin_many(
                        PinRequest(keys, "acme", 3600.0, 1 << 40, estimate_bytes=100)
                    ),
                    repeats,
                )
                release_ms = await _median_ms(backend.pins.release_expired, repeats)
                await backend.delete_many(extra)
                out.append(
                    {
                        "live_pins": size + PROMPT_CHUNKS,
                        "pin_32_chunks_ms": round(pin_ms, 3),
                        "repin_32_chunks_ms": round(repin_ms, 3),
                        "check_32_chunks_ms": round(check_ms, 3),
                        "release_ms": round(release_ms, 3),
                    }
                )
        finally:
            await backend.flush(None)
            await backend.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="valkey", choices=["redis", "valkey"])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = asyncio.run(_measure(args.flavor, [int(s) for s in args.sizes.split(",")], args.repeats))
    if args.json:
        print(json.dumps({"flavor": args.flavor, "rows": rows}, indent=2))
        return
    print(f"{args.flavor}: medians of {args.repeats} calls")
    print(f"{'live pins':>10} {'pin 32':>10} {'re-pin 32':>10} {'check 32':>10} {'release':>10}  (ms)")
    for row in rows:
        print(
            f"{row['live_pins']:>10} {row['pin_32_chunks_ms']:>10} {row['repin_32_chunks_ms']:>10} "
            f"{row['check_32_chunks_ms']:>10} {row['release_ms']:>10}"
        )


if __name__ == "__main__":
    main()
