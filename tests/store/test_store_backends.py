"""Conformance suite: every backend (memory, disk, fs, redis-server, valkey-server) honours the
same contract (see kvmesh.store.backends.base)."""

from __future__ import annotations

import asyncio

import pytest
from store_helpers import make_key, make_value

from kvmesh.store.backends.base import Backend, BackendStats


async def test_empty_batches(backend: Backend) -> None:
    assert await backend.exists_many([]) == []
    assert await backend.get_many([]) == []
    assert await backend.put_many([]) == 0
    assert await backend.delete_many([]) == 0


async def test_put_get_exists_roundtrip(backend: Backend) -> None:
    keys = [make_key(i) for i in range(5)]
    values = [make_value(i, 100 + i) for i in range(5)]
    assert await backend.put_many(list(zip(keys[:3], values[:3], strict=True))) == 3
    assert await backend.exists_many(keys) == [True, True, True, False, False]
    assert await backend.get_many(keys) == [values[0], values[1], values[2], None, None]


async def test_answers_follow_request_order_and_duplicates(backend: Backend) -> None:
    a, b = make_key(1), make_key(2)
    await backend.put_many([(a, b"A"), (b, b"B")])
    assert await backend.get_many([b, a, b, make_key(3)]) == [b"B", b"A", b"B", None]
    assert await backend.exists_many([b, b, a]) == [True, True, True]


async def test_overwrite_replaces_value(backend: Backend) -> None:
    key = make_key(7)
    await backend.put_many([(key, b"old")])
    await backend.put_many([(key, b"new-value")])
    assert await backend.get_many([key]) == [b"new-value"]


async def test_delete_many_counts_existing(backend: Backend) -> None:
    keys = [make_key(i) for i in range(4)]
    await backend.put_many([(k, make_value(i)) for i, k in enumerate(keys)])
    assert await backend.delete_many([keys[0], keys[2], make_key(99)]) == 2
    assert await backend.exists_many(keys) == [False, True, False, True]
    assert await backend.get_many([keys[0]]) == [None]


async def test_flush_by_group_leaves_other_groups(backend: Backend) -> None:
    ga, gb = "00000000000000aa", "00000000000000bb"
    a_keys = [make_key(i, ga) for i in range(3)]
    b_keys = [make_key(i, gb) for i in range(2)]
    await backend.put_many([(k, b"x") for k in a_keys + b_keys])
    assert await backend.flush(ga) == 3
    assert await backend.exists_many(a_keys + b_keys) == [False, False, False, True, True]
    assert await backend.flush(None) == 2
    assert await backend.exists_many(b_keys) == [False, False]


async def test_large_value_roundtrip(backend: Backend) -> None:
    key = make_key(42)
    value = make_value(42, 3 << 20)
    assert await backend.put_many([(key, value)]) == 1
    assert await backend.get_many([key]) == [value]


async def test_concurrent_writers_and_readers(backend: Backend) -> None:
    keys = [make_key(i) for i in range(40)]

    async def writer(part: int) -> None:
        for i in range(part, 40, 4):
            await backend.put_many([(keys[i], make_value(i, 512))])

    async def reader() -> list[bytes | None]:
        got: list[bytes | None] = []
        for _ in range(10):
            got.extend(await backend.get_many(keys))
            await asyncio.sleep(0)
        return got

    results = await asyncio.gather(*(writer(p) for p in range(4)), reader(), reader())
    for batch in results[4:]:
        assert isinstance(batch, list)
        for n, value in enumerate(batch):
            assert value is None or value == make_value(n % 40, 512)
    assert await backend.get_many(keys) == [make_value(i, 512) for i in range(40)]


async def test_stats_reports_kind(backend: Backend) -> None:
    await backend.put_many([(make_key(1), b"12345")])
    stats = await backend.stats()
    assert stats.kind == backend.kind
    if stats.num_chunks >= 0:
        assert stats.num_chunks == 1
    if backend.kind in ("memory", "disk", "fs"):
        assert stats.num_bytes == 5


@pytest.mark.parametrize("n", [1, 64])
async def test_batch_sizes(backend: Backend, n: int) -> None:
    items = [(make_key(i), make_value(i, 64)) for i in range(n)]
    assert await backend.put_many(items) == n
    assert await backend.get_many([k for k, _ in items]) == [v for _, v in items]


def test_backend_stats_document_lists_every_field_then_the_extras() -> None:
    stats = BackendStats("disk", num_chunks=3, num_bytes=300, capacity_bytes=1000, num_evictions=1)
    stats.extra["root"] = "/data"
    assert list(stats.to_dict().items()) == [
        ("kind", "disk"),
        ("num_chunks", 3),
        ("num_bytes", 300),
        ("capacity_bytes", 1000),
        ("num_evictions", 1),
        ("root", "/data"),
    ]
