"""File tiers translate I/O failures into TierUnavailableError, which the store turns into misses."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import make_chunk, make_key

from kvmesh.errors import TierUnavailableError
from kvmesh.store.backends.disk import DiskBackend
from kvmesh.store.backends.fs import SharedDirBackend
from kvmesh.store.codec import ChunkCodec
from kvmesh.store.tiered import Tier, TieredStore


async def test_disk_tier_on_an_unusable_path(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")
    backend = DiskBackend(blocker / "disk", 1 << 20)
    with pytest.raises(TierUnavailableError, match="cannot read index"):
        await backend.exists_many([make_key(1)])
    with pytest.raises(TierUnavailableError):
        await backend.put_many([(make_key(1), b"v")])


async def test_shared_dir_on_an_unusable_path(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")
    backend = SharedDirBackend(blocker / "shared")
    with pytest.raises(TierUnavailableError):
        await backend.put_many([(make_key(1), b"v")])
    with pytest.raises(TierUnavailableError):
        await backend.get_many([make_key(1)])
    assert await backend.exists_many([make_key(1)]) == [False]


async def test_store_over_broken_file_tiers_only_misses(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")
    store = TieredStore(
        [
            Tier("disk", DiskBackend(blocker / "disk", 1 << 20), timeout_s=5.0, queued=True),
            Tier("fs", SharedDirBackend(blocker / "fs"), timeout_s=5.0, queued=True),
        ],
        ChunkCodec(),
    )
    key = make_key(1)
    await store.put([(key, make_chunk(key))])
    await store.drain()
    assert await store.count_prefix([key]) == 0
    assert (await store.get_prefix([key])).num_chunks == 0
    assert store.tiers[0].counters.dropped_writes == 1
    assert store.tiers[0].counters.unavailable >= 2
    assert store.tiers[1].counters.dropped_writes == 1
    await store.aclose()
