"""KVCacheEngine: token-level lookup / retrieve / store over real tiers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvmesh.core.hashing import BlockHasher, Namespace
from kvmesh.store.cache_engine import KVCacheEngine
from kvmesh.store.codec import float32_to_bf16
from kvmesh.store.config import StoreConfig
from kvmesh.store.keys import StoreKey, namespace_group
from kvmesh.store.local_server import LocalServer

NS = Namespace("m", revision="r1")
CHUNK = 64


def _kv(tokens: int, seed: int = 0, dtype: str = "float32") -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal((2, 2, 2, tokens, 8)).astype(np.float32)
    if dtype == "bfloat16":
        return float32_to_bf16(values)
    return values.astype(dtype)


def _engine(**overrides: object) -> KVCacheEngine:
    options: dict[str, object] = {"chunk_size": CHUNK}
    options.update(overrides)
    return KVCacheEngine.from_config(StoreConfig(**options))  # type: ignore[arg-type]


TOKENS = list(range(1000, 1000 + 4 * CHUNK + 10))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
async def test_store_then_retrieve_full_chunks(dtype: str) -> None:
    engine = _engine()
    kv = _kv(len(TOKENS), dtype=dtype)
    await engine.store(TOKENS, NS, kv)
    assert await engine.lookup(TOKENS, NS) == 4 * CHUNK
    result = await engine.retrieve(TOKENS, NS)
    assert result.num_tokens == 4 * CHUNK
    assert result.tier == "cpu"
    assert result.kv is not None
    assert result.kv.flags.writeable
    np.testing.assert_array_equal(result.kv, kv[:, :, :, : 4 * CHUNK, :])
    await engine.aclose()


async def test_keys_follow_the_contract() -> None:
    engine = _engine(kv_dtype="float32", kv_layout="L2xH2xD8")
    await engine.store(TOKENS, NS, _kv(len(TOKENS)))
    expected = BlockHasher(NS.for_store("float32", "L2xH2xD8"), block_size=16).chunk_keys(TOKENS, CHUNK)
    keys = [StoreKey(namespace_group(NS), k) for k in expected]
    assert await engine.tiered.tiers[0].backend.exists_many(keys) == [True] * 4
    await engine.aclose()


async def test_prefix_sharing_and_divergence() -> None:
    engine = _engine()
    kv = _kv(len(TOKENS))
    await engine.store(TOKENS, NS, kv)
    diverged = TOKENS[: 2 * CHUNK + 5] + [7] * (2 * CHUNK)
    assert await engine.lookup(diverged, NS) == 2 * CHUNK
    result = await engine.retrieve(diverged, NS)
    assert result.kv is not None
    np.testing.assert_array_equal(result.kv, kv[:, :, :, : 2 * CHUNK, :])
    assert await engine.lookup(TOKENS, Namespace("m", revision="r2")) == 0
    assert await engine.lookup(TOKENS, Namespace("m", revision="r1", tenant="t")) == 0
    await engine.aclose()


async def test_max_tokens_and_short_prompts() -> None:
    engine = _engine()
    await engine.store(TOKENS, NS, _kv(len(TOKENS)))
    result = await engine.retrieve(TOKENS, NS, max_tokens=2 * CHUNK + 10)
    assert result.num_tokens == 2 * CHUNK
    assert (await engine.retrieve(TOKENS, NS, max_tokens=CHUNK - 1)).num_tokens == 0
    assert await engine.lookup(TOKENS[: CHUNK - 1], NS) == 0
    miss = await engine.retrieve([1, 2, 3], NS)
    assert (miss.num_tokens, miss.kv, miss.tier) == (0, None, None)
    await engine.aclose()


async def test_store_skips_present_and_skipped_chunks() -> None:
    engine = _engine()
    kv = _kv(len(TOKENS))
    await engine.store(TOKENS[: 2 * CHUNK], NS, kv[:, :, :, : 2 * CHUNK])
    before = engine.stats()["tiers"]["cpu"]["bytes_written"]  # type: ignore[index]
    await engine.store(TOKENS, NS, kv, skip_tokens=CHUNK + 3)
    after = engine.stats()["tiers"]["cpu"]["bytes_written"]  # type: ignore[index]
    one_chunk = (after - before) // 2
    assert after - before == 2 * one_chunk, "only chunks 2 and 3 are new"
    await engine.store(TOKENS, NS, kv)
    assert engine.stats()["tiers"]["cpu"]["bytes_written"] == after  # type: ignore[index]
    fresh = _engine()
    await fresh.store(TOKENS, NS, kv, skip_tokens=2 * CHUNK)
    assert await fresh.lookup(TOKENS, NS) == 0, "chunks 0 and 1 were skipped, so the prefix has a gap"
    await engine.aclose()
    await fresh.aclose()


async def test_bad_kv_is_a_caller_error() -> None:
    engine = _engine(kv_dtype="float16")
    with pytest.raises(ValueError, match="shaped"):
        await engine.store(TOKENS, NS, np.zeros((2, 2, 8), np.float32))
    with pytest.raises(ValueError, match="covers"):
        await engine.store(TOKENS[:10], NS, _kv(64))
    with pytest.raises(ValueError, match="bound"):
        await engine.store(TOKENS, NS, _kv(len(TOKENS)))
    await engine.aclose()


async def test_chunks_of_another_chunk_size_are_not_served() -> None:
    small = _engine(chunk_size=16)
    large = _engine(chunk_size=64)
    large.tiered = small.tiered
    await small.store(TOKENS, NS, _kv(len(TOKENS)))
    assert await large.lookup(TOKENS, NS) == 4 * CHUNK, "keys coincide at shared boundaries"
    assert (await large.retrieve(TOKENS, NS)).num_tokens == 0, "but 16-token chunks are not 64-token chunks"
    await small.aclose()


async def test_flush_by_namespace_covers_tenants() -> None:
    engine = _engine()
    kv = _kv(len(TOKENS))
    await engine.store(TOKENS, NS, kv)
    await engine.store(TOKENS, NS.for_tenant("acme"), kv)
    await engine.store(TOKENS, Namespace("other"), kv)
    assert await engine.flush(Namespace("m", revision="r1")) == 8
    assert await engine.lookup(TOKENS, NS.for_tenant("acme")) == 0
    assert await engine.lookup(TOKENS, Namespace("other")) == 4 * CHUNK
    assert await engine.flush(None) == 4
    await engine.aclose()


@pytest.mark.parametrize("codec", ["int8", "fp8"])
async def test_quantized_codec_round_trip_through_engine(codec: str) -> None:
    engine = _engine(codec=codec)
    kv = _kv(len(TOKENS))
    await engine.store(TOKENS, NS, kv)
    result = await engine.retrieve(TOKENS, NS)
    assert result.kv is not None and result.kv.dtype == np.float32
    assert np.max(np.abs(result.kv - kv[:, :, :, : 4 * CHUNK])) < 0.2
    await engine.aclose()


@pytest.mark.parametrize("flavor", ["redis", "valkey"])
async def test_replicas_share_chunks_through_a_remote_tier(
    flavor: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    server: LocalServer = request.getfixturevalue(f"{flavor}_server")
    prefix = f"share{flavor}{tmp_path.name[-8:]}"
    a = _engine(remote_url=server.url, redis_key_prefix=prefix, hmac_key="hex:00ff")
    b = _engine(
        remote_url=server.url,
        redis_key_prefix=prefix,
        hmac_key="hex:00ff",
        local_disk=f"file://{tmp_path}/disk",
        max_local_disk_size=0.01,
    )
    kv = _kv(len(TOKENS), dtype="bfloat16")
    await a.store(TOKENS, NS, kv)
    await a.drain()
    result = await b.retrieve(TOKENS, NS)
    assert result.tier == "redis"
    assert result.kv is not None
    np.testing.assert_array_equal(result.kv, kv[:, :, :, : 4 * CHUNK])
    await b.drain()
    again = await b.retrieve(TOKENS, NS)
    assert again.tier == "cpu"
    assert (
        await b.tiered.tiers[1].backend.exists_many(
            [
                StoreKey(namespace_group(NS), k)
                for k in BlockHasher(NS.for_store("", "")).chunk_keys(TOKENS, CHUNK)
            ]
        )
        == [True] * 4
    ), "promoted into the disk tier too"
    assert await a.flush(None) >= 4
    await a.aclose()
    await b.aclose()


async def test_shared_directory_between_two_engines(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/shared"
    a = KVCacheEngine.from_config(url)
    b = KVCacheEngine.from_config(url)
    tokens = list(range(600))
    kv = _kv(600)
    await a.store(tokens, NS, kv)
    await a.drain()
    result = await b.retrieve(tokens, NS)
    assert (result.num_tokens, result.tier) == (512, "fs")
    await a.aclose()
    await b.aclose()


async def test_stats_and_metrics() -> None:
    engine = _engine()
    await engine.store(TOKENS, NS, _kv(len(TOKENS)))
    await engine.lookup(TOKENS, NS)
    stats = engine.stats()
    assert stats["chunk_size"] == CHUNK
    assert stats["lookup_hit_chunks"] == 4
    assert stats["tiers"]["cpu"]["breaker"] == "closed"  # type: ignore[index]
    text = engine.metrics.render().decode()
    assert 'kvmesh_store_lookup_chunks_total{result="hit"} 4.0' in text
    await engine.aclose()


async def _put_chunks(engine: KVCacheEngine, tier: int, kv: np.ndarray, chunks: tuple[int, ...]) -> None:
    """Put chunks of ``TOKENS`` straight into one tier, as another writer would have."""
    keys = engine.chunk_keys(TOKENS, NS)
    codec = engine.tiered.codec
    items = [
        (keys[i], codec.encode(keys[i], kv[:, :, :, i * CHUNK : (i + 1) * CHUNK, :], "float32"))
        for i in chunks
    ]
    await engine.tiered.tiers[tier].backend.put_many(items)


async def test_store_reports_how_far_each_tier_holds_the_prompt(tmp_path: Path) -> None:
    engine = _engine(shared_dir=f"file://{tmp_path}/shared")
    reports: list[tuple[str, int]] = []

    def seen(tier: str, end: int) -> None:
        reports.append((tier, end))

    # Two chunks first; then the whole prompt, of which the first two chunks are held already.
    await engine.store(TOKENS, NS, _kv(2 * CHUNK), on_written=seen)
    await engine.drain()
    assert reports == [("cpu", 2 * CHUNK), ("fs", 2 * CHUNK)]
    await engine.store(TOKENS, NS, _kv(len(TOKENS)), skip_tokens=CHUNK, on_written=seen)
    await engine.drain()
    assert reports[2:] == [("cpu", 4 * CHUNK), ("fs", 4 * CHUNK)]
    # Nothing new for the RAM tier: it alone is reported, as holding what it held.
    await engine.store(TOKENS, NS, _kv(len(TOKENS)), on_written=seen)
    await engine.drain()
    assert reports[4:] == [("cpu", 4 * CHUNK)]
    await engine.aclose()


async def test_store_reports_a_first_tier_that_already_held_chunks(tmp_path: Path) -> None:
    engine = _engine(local_cpu=False, shared_dir=f"file://{tmp_path}/shared")
    reports: list[tuple[str, int]] = []

    def seen(tier: str, end: int) -> None:
        reports.append((tier, end))

    kv = _kv(len(TOKENS))
    # Another writer put the last chunk there; this store writes chunks 0 to 2 and leaves it out.
    await _put_chunks(engine, 0, kv, (3,))
    await engine.store(TOKENS, NS, kv, on_written=seen)
    await engine.drain()
    assert reports == [("fs", 4 * CHUNK)]
    await engine.aclose()


async def test_a_tier_is_reported_only_as_far_as_it_holds_the_prompt_from_its_start(tmp_path: Path) -> None:
    """The RAM tier kept chunks 0-1 that the shared tier never got (a dropped write, an eviction):
    a later store of the whole prompt writes chunks 2-3 everywhere, and the shared tier must not be
    reported as holding the prompt, since a reader's lookup stops at its missing chunk 0."""
    engine = _engine(shared_dir=f"file://{tmp_path}/shared")
    reports: list[tuple[str, int]] = []

    def seen(tier: str, end: int) -> None:
        reports.append((tier, end))

    keys = engine.chunk_keys(TOKENS, NS)
    kv = _kv(len(TOKENS))
    ram = engine.tiered.tiers[0]
    assert ram.name == "cpu"
    await _put_chunks(engine, 0, kv, (0, 1))
    await engine.store(TOKENS, NS, kv, on_written=seen)
    await engine.drain()
    assert reports == [("cpu", 4 * CHUNK)]
    assert await engine.tiered.tiers[1].backend.exists_many(keys) == [False, False, True, True]
    # Once the shared tier has chunks 0-1 too (another writer), a store that writes anything there
    # reports it whole, though this one skips the chunks it knows are stored (as an engine does).
    await _put_chunks(engine, 1, kv, (0, 1))
    await ram.backend.delete_many([keys[3]])
    await engine.store(TOKENS, NS, kv, skip_tokens=2 * CHUNK, on_written=seen)
    await engine.drain()
    assert reports[1:] == [("cpu", 4 * CHUNK), ("fs", 4 * CHUNK)]
    await engine.aclose()


async def test_local_flush_empties_ram_and_disk_and_keeps_the_shared_directory(tmp_path: Path) -> None:
    engine = _engine(
        local_disk=str(tmp_path / "disk"), max_local_disk_size=1, shared_dir=f"file://{tmp_path}/shared"
    )
    assert [t.name for t in engine.tiered.tiers] == ["cpu", "disk", "fs"]
    kv = _kv(len(TOKENS))
    await engine.store(TOKENS, NS, kv)
    await engine.drain()
    assert await engine.flush(None, local_only=True) == 2 * 4  # four chunks in RAM and on disk
    result = await engine.retrieve(TOKENS, NS)
    assert (result.num_tokens, result.tier) == (4 * CHUNK, "fs")
    parts = await engine.retrieve(TOKENS, NS, join=False)
    assert parts.kv is None and len(parts.parts) == 4 and parts.num_tokens == 4 * CHUNK
    np.testing.assert_array_equal(np.concatenate(parts.parts, axis=3), result.kv)
    await engine.aclose()
