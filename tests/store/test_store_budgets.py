"""Byte budgets hold under random workloads; the disk tier survives restarts."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_helpers import make_chunk, make_key, make_value

from kvmesh.store.backends import files
from kvmesh.store.backends.disk import DiskBackend
from kvmesh.store.backends.memory import MemoryBackend
from kvmesh.store.codec import ChunkCodec
from kvmesh.store.tiered import Tier, TieredStore

OPS = st.lists(
    st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 30), st.integers(1, 400)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 2000), ops=OPS)
def test_memory_tier_never_exceeds_its_budget(capacity: int, ops: list[tuple[str, int, int]]) -> None:
    async def run() -> None:
        backend = MemoryBackend(capacity)
        model: dict[int, int] = {}
        for op, k, size in ops:
            key = make_key(k)
            if op == "put":
                await backend.put_many([(key, make_value(k, size))])
                model[k] = size
            elif op == "get":
                await backend.get_many([key])
            else:
                await backend.delete_many([key])
            assert backend.num_bytes <= capacity
            held = [
                k2
                for k2, present in zip(
                    model, await backend.exists_many([make_key(x) for x in model]), strict=True
                )
                if present
            ]
            assert backend.num_bytes == sum(
                len(v) for v in await backend.get_many([make_key(x) for x in held]) if v is not None
            )

    asyncio.run(run())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(capacity=st.integers(1, 3000), ops=OPS, concurrency=st.integers(1, 4))
def test_disk_tier_never_exceeds_its_budget_on_disk(
    capacity: int, ops: list[tuple[str, int, int]], concurrency: int
) -> None:
    async def run(root: Path) -> None:
        backend = DiskBackend(root, capacity)

        async def worker(part: list[tuple[str, int, int]]) -> None:
            for op, k, size in part:
                key = make_key(k)
                if op == "put":
                    await backend.put_many([(key, make_value(k, size))])
                elif op == "get":
                    value = (await backend.get_many([key]))[0]
                    assert value is None or value == make_value(k, len(value))
                else:
                    await backend.delete_many([key])
                assert backend.num_bytes <= capacity
                assert backend.disk_usage_bytes() <= capacity

        await asyncio.gather(*(worker(ops[i::concurrency]) for i in range(concurrency)))
        assert backend.disk_usage_bytes() == backend.num_bytes
        reopened = DiskBackend(root, capacity)
        assert (await reopened.stats()).num_bytes == backend.num_bytes

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(Path(tmp)))


async def test_disk_restart_keeps_contents_and_lru_order(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    first = DiskBackend(root, 10_000)
    keys = [make_key(i) for i in range(5)]
    for n, key in enumerate(keys):
        await first.put_many([(key, make_value(n, 1000))])
        path = files.chunk_path(root, key)
        os.utime(path, ns=(1_000_000_000 * (n + 1), 1_000_000_000 * (n + 1)))
    await first.aclose()

    (root / keys[0].group / ".tmp-otherhost-1-abc").write_bytes(b"partial write")
    (root / keys[0].group / "not-a-chunk.txt").write_bytes(b"ignored")
    (root / "README").write_bytes(b"foreign file")

    second = DiskBackend(root, 10_000)
    assert await second.get_many(keys) == [make_value(n, 1000) for n in range(5)]
    stats = await second.stats()
    assert (stats.num_chunks, stats.num_bytes) == (5, 5000)
    assert not (root / keys[0].group / ".tmp-otherhost-1-abc").exists()
    assert (root / keys[0].group / "not-a-chunk.txt").exists()
    await second.aclose()

    smaller = DiskBackend(root, 3000)
    assert await smaller.exists_many(keys) == [False, False, True, True, True], "oldest files evicted first"
    assert smaller.disk_usage_bytes() == 3000
    await smaller.aclose()


async def test_disk_tier_in_a_store_survives_restart(tmp_path: Path) -> None:
    keys = [make_key(i) for i in range(3)]
    items = [(k, make_chunk(k, seed=n)) for n, k in enumerate(keys)]
    store = TieredStore([Tier("disk", DiskBackend(tmp_path, 1 << 20), queued=True)], ChunkCodec())
    await store.put(items)
    await store.aclose()
    reopened = TieredStore([Tier("disk", DiskBackend(tmp_path, 1 << 20), queued=True)], ChunkCodec())
    result = await reopened.get_prefix(keys)
    assert [c.data for c in result.chunks] == [v for _, v in items]
    await reopened.aclose()
