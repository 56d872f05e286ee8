"""File tiers map large chunk files instead of copying them where the file system is local: the
views read back right, outlive the file's removal or replacement, hold no file descriptor, are
unmapped with their last reference, and the RAM tier keeps them uncopied."""

from __future__ import annotations

import asyncio
import gc
import os
from pathlib import Path

import pytest
from store_helpers import make_key

from kvmesh.store.backends import files
from kvmesh.store.backends.disk import DiskBackend
from kvmesh.store.backends.fs import SharedDirBackend
from kvmesh.store.backends.memory import MemoryBackend
from kvmesh.store.config import StoreConfig, resolve_config
from kvmesh.store.factory import build_tiers

BIG = files.MAP_MIN_BYTES


async def test_a_mapped_chunk_outlives_its_file_being_replaced_and_removed(tmp_path: Path) -> None:
    backend = SharedDirBackend(tmp_path, mapped=True)
    key = make_key(1)
    first, second = b"a" * BIG, b"b" * (BIG + 7)
    await backend.put_many([(key, first)])
    (view,) = await backend.get_many([key])
    assert isinstance(view, memoryview) and files.is_mapping(view)
    await backend.put_many([(key, second)])  # a rename over the mapped file
    assert view == first
    assert await backend.get_many([key]) == [second]
    await backend.delete_many([key])
    assert view == first
    assert await backend.get_many([key]) == [None]
    await backend.aclose()


async def test_mappings_hold_no_descriptor_and_go_with_their_last_view(tmp_path: Path) -> None:
    backend = SharedDirBackend(tmp_path, mapped=True)
    keys = [make_key(i) for i in range(40)]
    await backend.put_many([(k, bytes([i]) * BIG) for i, k in enumerate(keys)])
    gc.collect()
    live_before = len(files._MAPPINGS)
    fds_before = len(os.listdir("/proc/self/fd"))
    views = await backend.get_many(keys)
    assert all(v is not None and files.is_mapping(v) for v in views)
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 1  # the read pool's threads may hold one
    assert len(files._MAPPINGS) == live_before + 40
    assert [v[0] if v is not None else None for v in views] == list(range(40))
    del views
    await asyncio.sleep(0)  # the executor future holding the batch lets go on the next loop turn
    gc.collect()
    assert len(files._MAPPINGS) == live_before  # unmapped


async def test_small_files_and_refused_mappings_are_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = SharedDirBackend(tmp_path, mapped=True)
    await backend.put_many([(make_key(1), b"small"), (make_key(2), b"x" * BIG)])
    small, _ = await backend.get_many([make_key(1), make_key(2)])
    assert isinstance(small, bytes) and small == b"small"
    monkeypatch.setattr(files, "_LIBC", None)
    (big,) = await backend.get_many([make_key(2)])
    assert isinstance(big, bytes) and big == b"x" * BIG


async def test_copied_reads_hand_out_bytes(tmp_path: Path) -> None:
    backend = DiskBackend(tmp_path, 1 << 20, mapped=False)
    await backend.put_many([(make_key(1), b"abc")])
    assert await backend.get_many([make_key(1)]) == [b"abc"]
    assert isinstance((await backend.get_many([make_key(1)]))[0], bytes)


async def test_an_empty_chunk_file_reads_as_empty(tmp_path: Path) -> None:
    backend = SharedDirBackend(tmp_path, mapped=True)
    key = make_key(3)
    path = files.chunk_path(tmp_path, key)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    assert await backend.get_many([key]) == [b""]


async def test_the_ram_tier_keeps_mapped_views_and_copies_writable_buffers(tmp_path: Path) -> None:
    disk = DiskBackend(tmp_path, 4 * BIG, mapped=True)
    await disk.put_many([(make_key(1), b"x" * BIG)])
    (view,) = await disk.get_many([make_key(1)])
    assert isinstance(view, memoryview) and files.is_mapping(view)
    ram = MemoryBackend(4 * BIG)
    buffer = bytearray(b"y" * 10)
    await ram.put_many([(make_key(1), view), (make_key(2), memoryview(buffer))])
    kept, copied = await ram.get_many([make_key(1), make_key(2)])
    assert kept is view
    buffer[0] = ord("z")
    assert copied == b"y" * 10


def test_file_system_types_come_from_the_mount_table(tmp_path: Path) -> None:
    if not Path("/proc/self/mountinfo").exists():
        pytest.skip("no /proc/self/mountinfo")
    assert files.filesystem_type(Path("/proc/self")) == "proc"
    assert not files.is_network_fs(Path("/proc/self"))
    assert files.filesystem_type(tmp_path) is not None


def test_mapping_follows_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = StoreConfig(
        local_disk=str(tmp_path / "d"), max_local_disk_size=1, shared_dir=str(tmp_path / "s")
    )
    tiers = {t.name: t.backend for t in build_tiers(config)}
    disk, shared = tiers["disk"], tiers["fs"]
    assert isinstance(disk, DiskBackend) and isinstance(shared, SharedDirBackend)
    expected = not files.is_network_fs(tmp_path)
    assert disk.mapped is expected and shared.mapped is expected
    monkeypatch.setenv("KVMESH_MMAP_READS", "false")
    resolved = resolve_config(f"file://{tmp_path / 's'}")
    assert resolved.mmap_reads is False
    assert not any(getattr(t.backend, "mapped", False) for t in build_tiers(resolved))
