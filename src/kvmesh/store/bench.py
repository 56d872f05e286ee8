"""``kvmesh store bench``: per-tier put/get throughput next to a baseline on the same bytes.

Each tier is measured as the store runs it: a one-tier :class:`~kvmesh.store.tiered.TieredStore`
(breaker, timeout, codec) fed with encoded 256-token chunks of a realistic KV shape.

==========  ===================================================  =================================
tier        put / get measured                                   baseline in the same run
==========  ===================================================  =================================
cpu         encode + insert / locate + verify (zero-copy view)   numpy memcpy of the same bytes
            (encode into a buffer the tier recycled)
disk, fs    queue + tmp-write + rename / read + verify           plain open/write/close, open/read
redis       queue + EXISTS + pipelined SET /                     redis-py pipelined SET / GET of
valkey      EXISTS + pipelined GET + verify                      the same values, same client
==========  ===================================================  =================================

The RAM tier's put includes encoding (the copy and checksum that make a chunk); the slower tiers
are written from that same encoded chunk, so their put starts from encoded bytes, as the baseline
does.

Baseline and tier runs alternate (baseline, tier, baseline, tier …) and the median of each is
reported, so background load hits both alike. ``retrieve`` rows add the engine-level assembly of
the chunks into one (L, 2, H, T, D) array (one more copy) for the cpu tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import msgspec
import numpy as np
import redis.asyncio as aioredis

from kvmesh.core.types import BlockKey
from kvmesh.store.backends.base import Backend, ChunkData
from kvmesh.store.backends.disk import DiskBackend
from kvmesh.store.backends.fs import SharedDirBackend
from kvmesh.store.backends.memory import MemoryBackend
from kvmesh.store.backends.redis import RedisBackend, normalize_url
from kvmesh.store.codec import ChunkCodec, Codec, float32_to_bf16
from kvmesh.store.keys import StoreKey
from kvmesh.store.local_server import LocalServer, find_server_binary
from kvmesh.store.tiered import Tier, TieredStore

SHAPES: dict[str, tuple[int, int, int, str]] = {
    "llama-3.1-8b": (32, 8, 128, "bfloat16"),
    "qwen3-0.6b": (28, 8, 128, "bfloat16"),
    "smollm2-135m": (30, 3, 64, "bfloat16"),
}
"""name → (layers, kv heads, head dim, dtype)."""
TIERS = ("cpu", "disk", "fs", "redis", "valkey")
BENCH_GROUP = "0000000000bec400"


@dataclass(slots=True)
class BenchRow:
    tier: str
    op: str
    gbps: float
    baseline: str
    baseline_gbps: float

    @property
    def ratio(self) -> float:
        return self.gbps / self.baseline_gbps if self.baseline_gbps else 0.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "ratio": round(self.ratio, 3)}


@dataclass(slots=True)
class BenchReport:
    shape: str
    kv_shape: tuple[int, ...]
    dtype: str
    codec: str
    chunk_bytes: int
    num_chunks: int
    iterations: int
    rows: list[BenchRow]
    skipped: dict[str, str]

    def to_dict(self) -> dict[str, object]:
        return {
            "shape": self.shape,
            "kv_shape": list(self.kv_shape),
            "dtype": self.dtype,
            "codec": self.codec,
            "chunk_bytes": self.chunk_bytes,
            "num_chunks": self.num_chunks,
            "iterations": self.iterations,
            "rows": [r.to_dict() for r in self.rows],
            "skipped": self.skipped,
        }

    def to_json(self) -> bytes:
        return msgspec.json.encode(self.to_dict())


@dataclass(slots=True)
class BenchOptions:
    shape: str = "llama-3.1-8b"
    chunk_tokens: int = 256
    num_chunks: int = 4
    iterations: int = 5
    codec: str = "raw"
    tiers: tuple[str, ...] = TIERS
    redis_url: str | None = None
    valkey_url: str | None = None
    workdir: str | None = None


class _Timer:
    def __init__(self) -> None:
        self.samples: list[float] = []

    async def measure(self, nbytes: int, fn: Callable[[], Awaitable[object]]) -> None:
        start = time.perf_counter()
        await fn()
        self.samples.append(nbytes / (time.perf_counter() - start) / 1e9)

    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else 0.0


def _make_chunks(options: BenchOptions) -> tuple[list[np.ndarray], list[StoreKey], tuple[int, ...], str]:
    layers, heads, dim, dtype = SHAPES[options.shape]
    shape = (layers, 2, heads, options.chunk_tokens, dim)
    rng = np.random.default_rng(0)
    arrays = []
    for _ in range(options.num_chunks):
        values = rng.standard_normal(shape, dtype=np.float32)
        arrays.append(float32_to_bf16(values) if dtype == "bfloat16" else values.astype(dtype))
    keys = [StoreKey(BENCH_GROUP, BlockKey(i.to_bytes(16, "big"))) for i in range(options.num_chunks)]
    return arrays, keys, shape, dtype


def _store_for(tier: str, backend: Backend, codec: ChunkCodec) -> TieredStore:
    queued = tier != "cpu"
    timeout_s = None if tier == "cpu" else 60.0
    return TieredStore(
        [Tier(tier, backend, timeout_s=timeout_s, queued=queued, max_queue_bytes=1 << 40)], codec
    )


async def _bench_tier(
    tier: str,
    backend: Backend,
    baseline: _Baseline,
    arrays: list[np.ndarray],
    keys: list[StoreKey],
    codec: ChunkCodec,
    iterations: int,
) -> list[BenchRow]:
    store = _store_for(tier, backend, codec)
    encoded = [codec.encode(k, a) for k, a in zip(keys, arrays, strict=True)]
    nbytes = sum(len(e) for e in encoded)
    put_t, get_t, base_put, base_get, retrieve_t = _Timer(), _Timer(), _Timer(), _Timer(), _Timer()

    async def tier_put() -> None:
        # The RAM tier's put is the encode (its one copy); slower tiers write the encoded chunk
        # the engine already made for the RAM tier, so their put starts from encoded bytes.
        items: list[tuple[StoreKey, ChunkData]]
        if isinstance(backend, MemoryBackend):
            take = backend.buffers.take
            items = [(k, codec.encode(k, a, into=take)) for k, a in zip(keys, arrays, strict=True)]
        else:
            items = list(zip(keys, encoded, strict=True))
        await store.put(items)
        await store.drain()

    async def tier_get() -> object:
        result = await store.get_prefix(keys)
        assert result.num_chunks == len(keys), f"bench: tier {tier} served {result.num_chunks}/{len(keys)}"
        return result

    async def tier_retrieve() -> object:
        result = await store.get_prefix(keys)
        return np.concatenate([c.chunk.kv for c in result.chunks], axis=3)

    for _ in range(iterations):
        await baseline.clear()
        await base_put.measure(nbytes, lambda: baseline.put(encoded))
        await base_get.measure(nbytes, lambda: baseline.get(len(encoded)))
        await backend.flush(BENCH_GROUP)
        await put_t.measure(nbytes, tier_put)
        await get_t.measure(nbytes, tier_get)
        if tier == "cpu":
            await retrieve_t.measure(nbytes, tier_retrieve)
    await baseline.clear()
    await backend.flush(BENCH_GROUP)
    await store.aclose()
    rows = [
        BenchRow(tier, "put", put_t.median(), baseline.name_put, base_put.median()),
        BenchRow(tier, "get", get_t.median(), baseline.name_get, base_get.median()),
    ]
    if tier == "cpu":
        rows.append(BenchRow(tier, "retrieve", retrieve_t.median(), baseline.name_get, base_get.median()))
    return rows


class _Baseline(Protocol):
    """The raw operation a tier is measured against, on the same bytes."""

    name_put: str
    name_get: str

    async def put(self, values: list[bytes]) -> None: ...

    async def get(self, n: int) -> object:
        """Read back ``n`` values and return them (freed after the timer stops, as tier reads are)."""
        ...

    async def clear(self) -> None: ...


class _MemcpyBaseline:
    name_put = name_get = "memcpy"

    def __init__(self, values: list[bytes]) -> None:
        self._src = [np.frombuffer(v, dtype=np.uint8) for v in values]
        self._held = [np.empty_like(s) for s in self._src]
        self._out = [np.empty_like(s) for s in self._src]

    async def put(self, values: list[bytes]) -> None:
        for src, held in zip(self._src, self._held, strict=True):
            np.copyto(held, src)

    async def get(self, n: int) -> object:
        for held, out in zip(self._held[:n], self._out[:n], strict=True):
            np.copyto(out, held)
        return self._out

    async def clear(self) -> None:
        return None


class _FileBaseline:
    name_put = "file write"
    name_get = "file read"

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _write(self, values: list[bytes]) -> None:
        for n, value in enumerate(values):
            with open(self.root / f"raw-{n}", "wb") as f:
                f.write(value)

    def _read(self, n: int) -> list[bytes]:
        out = []
        for i in range(n):
            with open(self.root / f"raw-{i}", "rb") as f:
                out.append(f.read())
        return out

    async def put(self, values: list[bytes]) -> None:
        await asyncio.to_thread(self._write, values)

    async def get(self, n: int) -> object:
        return await asyncio.to_thread(self._read, n)

    async def clear(self) -> None:
        for path in self.root.glob("raw-*"):
            path.unlink()


class _RedisBaseline:
    name_put = "redis-py pipelined SET"
    name_get = "redis-py pipelined GET"

    def __init__(self, url: str) -> None:
        real_url, _ = normalize_url(url)
        self.client = aioredis.Redis.from_url(real_url, socket_timeout=60.0, socket_connect_timeout=60.0)

    async def put(self, values: list[bytes]) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            for n, value in enumerate(values):
                pipe.set(f"kvmesh-bench-raw:{n}", value)
            await pipe.execute()

    async def get(self, n: int) -> object:
        async with self.client.pipeline(transaction=False) as pipe:
            for i in range(n):
                pipe.get(f"kvmesh-bench-raw:{i}")
            return await pipe.execute()

    async def clear(self) -> None:
        keys = [k async for k in self.client.scan_iter(match="kvmesh-bench-raw:*")]
        if keys:
            await self.client.unlink(*keys)

    async def aclose(self) -> None:
        await self.client.aclose()


@contextlib.contextmanager
def _servers(options: BenchOptions, skipped: dict[str, str]) -> Iterator[dict[str, str]]:
    urls: dict[str, str] = {}
    started: list[LocalServer] = []
    try:
        for flavor, given in (("redis", options.redis_url), ("valkey", options.valkey_url)):
            if flavor not in options.tiers:
                continue
            if given:
                urls[flavor] = given
            elif find_server_binary(flavor) is None:
                skipped[flavor] = f"no {flavor}-server binary and no --{flavor}-url"
            else:
                server = LocalServer(flavor).start()
                started.append(server)
                urls[flavor] = server.url
        yield urls
    finally:
        for server in started:
            server.close()


async def run_bench(options: BenchOptions, progress: Callable[[str], None] | None = None) -> BenchReport:
    """Measure every requested tier; tiers whose server is missing are listed in ``skipped``."""
    unknown = set(options.tiers) - set(TIERS)
    if unknown:
        raise ValueError(f"unknown tiers {sorted(unknown)}; expected some of {list(TIERS)}")
    if options.shape not in SHAPES:
        raise ValueError(f"unknown shape {options.shape!r}; expected one of {sorted(SHAPES)}")
    arrays, keys, shape, dtype = _make_chunks(options)
    codec = ChunkCodec(Codec.parse(options.codec))
    chunk_bytes = len(codec.encode(keys[0], arrays[0]))
    rows: list[BenchRow] = []
    skipped: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        workdir = Path(
            options.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmesh-bench-"))
        )
        urls = stack.enter_context(_servers(options, skipped))
        for tier in options.tiers:
            if tier in skipped:
                continue
            if progress:
                progress(tier)
            backend: Backend
            baseline: _Baseline
            if tier == "cpu":
                backend = MemoryBackend(chunk_bytes * len(keys) * 2)
                baseline = _MemcpyBaseline([codec.encode(k, a) for k, a in zip(keys, arrays, strict=True)])
            elif tier in ("disk", "fs"):
                root = workdir / f"{tier}-{os.getpid()}"
                raw = workdir / f"{tier}-raw-{os.getpid()}"
                # a --dir of the user's keeps nothing of the run (on /dev/shm, not even empty dirs)
                stack.callback(shutil.rmtree, root, ignore_errors=True)
                stack.callback(shutil.rmtree, raw, ignore_errors=True)
                backend = (
                    DiskBackend(root, chunk_bytes * len(keys) * 2)
                    if tier == "disk"
                    else SharedDirBackend(root)
                )
                baseline = _FileBaseline(raw)
            else:
                url = urls[tier]
                backend = RedisBackend(url, key_prefix="kvmesh-bench", socket_timeout_s=60.0)
                baseline = _RedisBaseline(url)
            try:
                rows += await _bench_tier(tier, backend, baseline, arrays, keys, codec, options.iterations)
            finally:
                if isinstance(baseline, _RedisBaseline):
                    await baseline.aclose()
    return BenchReport(
        shape=options.shape,
        kv_shape=shape,
        dtype=dtype,
        codec=codec.codec.value,
        chunk_bytes=chunk_bytes,
        num_chunks=len(keys),
        iterations=options.iterations,
        rows=rows,
        skipped=skipped,
    )
