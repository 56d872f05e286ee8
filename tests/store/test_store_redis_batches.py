"""A Redis/Valkey write of many large chunks goes as several bounded pipelines, all of it stored."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from store_helpers import make_key, make_value, unique_prefix

from kvmesh.store.backends import redis as redis_backend
from kvmesh.store.backends.redis import RedisBackend, byte_batches
from kvmesh.store.local_server import LocalServer


@given(st.lists(st.integers(0, 100), max_size=40), st.integers(1, 150))
def test_byte_batches_keep_order_and_bound_every_run(sizes: list[int], limit: int) -> None:
    calls = list(range(len(sizes)))
    batches = byte_batches(calls, sizes, limit)
    assert [c for batch in batches for c in batch] == calls
    for batch in batches:
        assert batch, "no empty pipeline"
        total = sum(sizes[c] for c in batch)
        assert total <= limit or len(batch) == 1
    # each cut was needed: the next call would have overflowed the run before it
    for before, after in itertools.pairwise(batches):
        assert sum(sizes[c] for c in before) + sizes[after[0]] > limit


@pytest.mark.parametrize("kind", ["redis", "valkey"])
async def test_a_write_larger_than_one_pipeline_is_stored_whole(
    kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    server: LocalServer = request.getfixturevalue(f"{kind}_server")
    backend = RedisBackend(server.url, key_prefix=unique_prefix())
    monkeypatch.setattr(redis_backend, "MAX_PIPELINE_BYTES", 2500)
    pipelines: list[int] = []
    run = backend._pipeline

    async def counted(op: str, calls: list) -> list:  # type: ignore[type-arg]
        if op == "SET":
            pipelines.append(len(calls))
        return await run(op, calls)

    monkeypatch.setattr(backend, "_pipeline", counted)
    items = [(make_key(i), make_value(i, 1000)) for i in range(7)]
    try:
        assert await backend.put_many(items) == 7
        assert pipelines == [2, 2, 2, 1]
        assert await backend.get_many([k for k, _ in items]) == [v for _, v in items]
    finally:
        await backend.flush()
        await backend.aclose()
