"""The local tiers (memory, disk) report the chunks each call stored and dropped, evictions included;
KVCacheEngine watches those tiers only."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from store_helpers import make_key

from kvmesh.store.backends.changes import Watchable
from kvmesh.store.backends.disk import DiskBackend
from kvmesh.store.backends.memory import MemoryBackend
from kvmesh.store.cache_engine import KVCacheEngine
from kvmesh.store.config import GB, StoreConfig
from kvmesh.store.keys import StoreKey

CHUNK = b"x" * 100
"""Every value is 100 bytes: a budget of 250 holds two."""


class Heard:
    """Every report, in order."""

    def __init__(self) -> None:
        self.reports: list[tuple[list[StoreKey], list[StoreKey]]] = []

    def __call__(self, stored: list[StoreKey], removed: list[StoreKey]) -> None:
        self.reports.append((stored, removed))

    def take(self) -> list[tuple[list[StoreKey], list[StoreKey]]]:
        reports, self.reports = self.reports, []
        return reports


@pytest.fixture(params=["memory", "disk"])
async def tier(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[MemoryBackend | DiskBackend]:
    """A local tier with room for two values."""
    backend = MemoryBackend(250) if request.param == "memory" else DiskBackend(tmp_path / "disk", 250)
    try:
        yield backend
    finally:
        await backend.aclose()


k = [make_key(i) for i in range(8)]


async def test_puts_report_what_they_stored_and_evicted(tier: MemoryBackend | DiskBackend) -> None:
    heard = Heard()
    tier.on_change = heard
    await tier.put_many([(k[0], CHUNK)])
    await tier.put_many([(k[1], CHUNK), (k[2], CHUNK)])
    assert heard.take() == [([k[0]], []), ([k[1], k[2]], [k[0]])]
    # k3 evicts k1 and k4 evicts k2. The memory tier then evicts k3 for k5 (written by the same
    # call: no news of k3); the disk tier refuses k5 (it evicts only what it held before the call).
    await tier.put_many([(k[3], CHUNK), (k[4], CHUNK), (k[5], CHUNK)])
    kept = [k[4], k[5]] if isinstance(tier, MemoryBackend) else [k[3], k[4]]
    assert heard.take() == [(kept, [k[1], k[2]])]
    assert [key for key, held in zip(k, await tier.exists_many(k), strict=True) if held] == kept


async def test_overwrites_deletes_and_flushes_are_reported(tier: MemoryBackend | DiskBackend) -> None:
    heard = Heard()
    tier.on_change = heard
    await tier.put_many([(k[0], CHUNK), (k[1], CHUNK)])
    await tier.put_many([(k[1], b"y" * 100)])  # held before and after: stored again, nothing dropped
    # Larger than the budget: refused, and the old value is gone; the disk tier has made room first.
    await tier.put_many([(k[0], b"z" * 300)])
    await tier.delete_many([k[1], k[7]])
    await tier.put_many([(k[2], CHUNK), (k[3], CHUNK)])
    await tier.flush(None)
    memory = isinstance(tier, MemoryBackend)
    oversized: list[tuple[list[StoreKey], list[StoreKey]]] = (
        [([], [k[0]]), ([], [k[1]])] if memory else [([], [k[0], k[1]])]
    )
    assert heard.take() == [
        ([k[0], k[1]], []),
        ([k[1]], []),
        *oversized,
        ([k[2], k[3]], []),
        ([], [k[2], k[3]]),
    ]
    await tier.delete_many([k[5]])
    await tier.put_many([])
    assert heard.take() == [], "a call that changed nothing says nothing"


async def test_nobody_listening_by_default_and_after_unhooking(tier: MemoryBackend | DiskBackend) -> None:
    assert isinstance(tier, Watchable) and tier.on_change is None
    heard = Heard()
    tier.on_change = heard
    tier.on_change = None
    await tier.put_many([(k[0], CHUNK), (k[1], CHUNK), (k[2], CHUNK)])
    assert heard.reports == []


async def test_a_failed_disk_write_reports_what_it_evicted(tmp_path: Path) -> None:
    from kvmesh.errors import TierUnavailableError

    disk = DiskBackend(tmp_path / "disk", 250)
    heard = Heard()
    disk.on_change = heard
    await disk.put_many([(k[0], CHUNK), (k[1], CHUNK)])
    heard.take()
    group_dir = tmp_path / "disk" / k[2].group
    for path in group_dir.iterdir():
        path.unlink()
    group_dir.rmdir()
    group_dir.write_text("a file where the group's directory should be: the write fails")
    with pytest.raises(TierUnavailableError):
        await disk.put_many([(k[2], CHUNK)])
    assert heard.take() == [([], [k[0]])]
    assert await disk.exists_many(k[:3]) == [False, True, False]
    await disk.aclose()


async def test_a_disk_chunk_file_gone_behind_its_back_is_reported_when_read(tmp_path: Path) -> None:
    disk = DiskBackend(tmp_path / "disk", 250)
    heard = Heard()
    disk.on_change = heard
    await disk.put_many([(k[0], CHUNK), (k[1], CHUNK)])
    heard.take()
    (tmp_path / "disk" / k[0].group / f"{k[0].chunk.hex()}.kvc").unlink()
    assert await disk.get_many([k[0], k[1]]) == [None, CHUNK]
    assert heard.take() == [([], [k[0]])]
    await disk.aclose()


async def test_the_engine_watches_its_local_tiers_only(tmp_path: Path) -> None:
    config = StoreConfig(
        local_disk=str(tmp_path / "disk"),
        max_local_disk_size=1 / GB * 10_000,
        shared_dir=str(tmp_path / "shared"),
    )
    engine = KVCacheEngine.from_config(config)
    heard: list[tuple[str, list[StoreKey], list[StoreKey]]] = []
    assert engine.watch_local_tiers(lambda tier, stored, removed: heard.append((tier, stored, removed))) == [
        "cpu",
        "disk",
    ]
    backends = {t.name: t.backend for t in engine.tiered.tiers}
    assert backends["cpu"].on_change is not None  # type: ignore[attr-defined]
    assert backends["disk"].on_change is not None  # type: ignore[attr-defined]
    assert not hasattr(backends["fs"], "on_change"), "a shared directory is not watched"
    await engine.tiered.put([(k[0], CHUNK)])
    await engine.drain()
    assert heard == [("cpu", [k[0]], []), ("disk", [k[0]], [])]
    assert engine.watch_local_tiers(None) == ["cpu", "disk"]
    assert backends["cpu"].on_change is None  # type: ignore[attr-defined]
    await engine.aclose()


async def test_a_store_without_local_tiers_watches_nothing(tmp_path: Path) -> None:
    engine = KVCacheEngine.from_config(StoreConfig(local_cpu=False, shared_dir=str(tmp_path / "shared")))
    assert engine.watch_local_tiers(lambda *_: None) == []
    await engine.aclose()
