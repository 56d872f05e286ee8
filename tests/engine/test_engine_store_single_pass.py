"""A prefix another engine wrote to Redis is found and read in one pass: the prompt's store keys
hashed once, each tier asked once which chunks it holds, each chunk read once.

Real parts: a redis-server on a loopback port behind the store's RAM tier, two emulated engines
serving HTTP. The backends and the hasher are wrapped only to count their calls.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_engine_emulated_store import CHUNK, PROMPT, QWEN, SUFFIX, complete, store_engine

from kvmesh.core.hashing import BlockHasher
from kvmesh.store.local_server import LocalServer, find_server_binary


@pytest.fixture
def redis_url() -> Iterator[str]:
    if find_server_binary("redis") is None:
        pytest.skip("redis-server binary not found; apt-get install redis-server (scripts/system-deps.sh)")
    server = LocalServer("redis").start()
    try:
        yield server.url
    finally:
        server.close()


def count_backend_calls(engine: Any, calls: Counter[tuple[str, str]], keys: Counter[tuple[str, str]]) -> None:
    """Count each tier's ``exists_many``/``get_many`` calls and the keys they name."""
    for tier in engine.tiered.tiers:
        for op in ("exists_many", "get_many"):
            inner = getattr(tier.backend, op)

            def counted(batch: Any, *args: Any, _inner: Any = inner, _key: Any = (tier.name, op)) -> Any:
                calls[_key] += 1
                keys[_key] += len(batch)
                return _inner(batch, *args)

            setattr(tier.backend, op, counted)


async def test_a_redis_hit_hashes_the_prompt_once_checks_each_tier_once_and_reads_each_chunk_once(
    redis_url: str, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = await make_engine(QWEN, store=redis_url)
    reader = await make_engine(QWEN, store=redis_url)
    await complete(writer, PROMPT)
    await writer.core.wait_store_writes()

    hashed: list[int] = []
    chunk_keys = BlockHasher.chunk_keys

    def counting_chunk_keys(self: BlockHasher, tokens: Any, chunk_size: int = CHUNK) -> Any:
        hashed.append(len(tokens))
        return chunk_keys(self, tokens, chunk_size)

    monkeypatch.setattr(BlockHasher, "chunk_keys", counting_chunk_keys)
    calls: Counter[tuple[str, str]] = Counter()
    keys: Counter[tuple[str, str]] = Counter()
    engine = store_engine(reader)
    assert [t.name for t in engine.tiered.tiers] == ["cpu", "redis"]
    count_backend_calls(engine, calls, keys)

    cached, _ = await complete(reader, PROMPT + SUFFIX)
    await reader.core.wait_store_writes()

    assert cached == 4 * CHUNK
    assert reader.core.stats.cached_tokens_by_tier == {"SHARED": 4 * CHUNK}
    assert len(hashed) == 1, f"the prompt's store keys were hashed {len(hashed)} times"
    assert calls[("redis", "exists_many")] == 1 and keys[("redis", "exists_many")] == 4
    assert calls[("redis", "get_many")] == 1 and keys[("redis", "get_many")] == 4
    assert calls[("cpu", "exists_many")] == 1 and keys[("cpu", "exists_many")] == 4
    assert calls[("cpu", "get_many")] == 0, "the RAM tier held nothing to read"


async def test_a_prefix_the_device_tier_holds_reads_no_chunk(
    redis_url: str, make_engine: Callable[..., Any]
) -> None:
    engine_server = await make_engine(QWEN, store=redis_url)
    await complete(engine_server, PROMPT + SUFFIX)
    await engine_server.core.wait_store_writes()
    calls: Counter[tuple[str, str]] = Counter()
    keys: Counter[tuple[str, str]] = Counter()
    count_backend_calls(store_engine(engine_server), calls, keys)

    # A longer prompt: the device tier holds more of it than the store (4 chunks), so no chunk is
    # read (its fifth chunk is then written, which asks the RAM tier what it holds).
    cached, _ = await complete(engine_server, PROMPT + SUFFIX + SUFFIX + SUFFIX)
    assert cached == len(PROMPT + SUFFIX) // 16 * 16 > 4 * CHUNK
    assert engine_server.core.stats.cached_tokens_by_tier == {"GPU": cached}
    assert calls[("cpu", "get_many")] == 0 and calls[("redis", "get_many")] == 0
