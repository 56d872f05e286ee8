"""File tiers map large chunk files instead of copying them (by default where the directory is
memory-backed): the views read back right, outlive the file's removal or replacement, hold no file
descriptor and are unmapped with their last reference; the RAM tier keeps copies, never mappings;
the mount table tells a memory-backed directory."""

from __future__ import annotations

import asyncio
import gc
import os
from pathlib import Path

import pytest
from store_helpers import make_chunk, make_key

from kvmesh.store.backends import files
from kvmesh.store.backends.disk import DiskBackend
from kvmesh.store.backends.fs import SharedDirBackend
from kvmesh.store.backends.memory import MemoryBackend
from kvmesh.store.codec import ChunkCodec
from kvmesh.store.config import StoreConfig, resolve_config
from kvmesh.store.factory import build_tiers
from kvmesh.store.tiered import Tier, TieredStore

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
    # The executor future holding the batch lets go once the loop has run its callbacks (one turn
    # on a quiet machine, a few on a busy one).
    for _ in range(200):
        await asyncio.sleep(0.01)
        gc.collect()
        if len(files._MAPPINGS) == live_before:
            break
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


async def test_mapped_chunks_are_not_promoted_into_the_ram_tier(tmp_path: Path) -> None:
    """A chunk read through a mapping already lies in memory: the RAM tier takes neither a copy
    (which would double it) nor the mapping (which would pin the file), and once the request lets
    go of the chunk nothing holds the mapping. A copied read is promoted as before."""
    key, small_key = make_key(1), make_key(2)
    chunk = make_chunk(key, tokens=BIG // 64)  # 1 x 2 x 2 x T x 8 float32: just over 1 MiB
    small = make_chunk(small_key)  # under MAP_MIN_BYTES: copied
    shared = SharedDirBackend(tmp_path, mapped=True)
    await shared.put_many([(key, chunk), (small_key, small)])
    ram = MemoryBackend(16 * BIG)
    store = TieredStore([Tier("cpu", ram), Tier("fs", shared, queued=True)], ChunkCodec())
    gc.collect()
    live_before = len(files._MAPPINGS)
    found = await store.get_prefix([key])
    assert found.num_chunks == 1 and files.is_mapping(found.chunks[0].data)
    assert (await store.get_prefix([small_key])).num_chunks == 1
    await store.drain()
    assert await ram.get_many([key, small_key]) == [None, small]
    del found
    await asyncio.sleep(0)
    gc.collect()
    assert len(files._MAPPINGS) == live_before
    await store.aclose()


async def test_the_ram_tier_copies_views(tmp_path: Path) -> None:
    ram = MemoryBackend(1 << 20)
    buffer = bytearray(b"y" * 10)
    await ram.put_many([(make_key(2), memoryview(buffer))])
    buffer[0] = ord("z")
    assert await ram.get_many([make_key(2)]) == [b"y" * 10]


MOUNTINFO = r"""22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
25 22 0:21 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw
31 22 0:40 / /mnt/nfs rw,relatime shared:9 - nfs4 server:/export rw,vers=4.2
32 31 0:41 / /mnt/nfs/scratch rw shared:10 - tmpfs tmpfs rw
33 22 0:42 / /mnt/with\040space rw - tmpfs tmpfs rw
34 22 0:43 / /mnt/tab\011dir rw - nfs server:/x rw
35 22 0:44 / /mnt/stacked rw - ext4 /dev/vdb rw
36 35 0:45 / /mnt/stacked rw - tmpfs tmpfs rw
garbage line without a separator
"""


@pytest.mark.parametrize(
    ("path", "fs_type"),
    [
        ("/var/cache/kvmesh", "ext4"),
        ("/dev/shm/kvmesh", "tmpfs"),
        ("/dev/shmx", "ext4"),  # a prefix of the name is not the mount point
        ("/mnt/nfs/fleet", "nfs4"),
        ("/mnt/nfs/scratch/a", "tmpfs"),  # the longest mount point wins
        ("/mnt/with space/a", "tmpfs"),  # \040 is a space
        ("/mnt/tab\tdir/a", "nfs"),  # every octal escape is decoded
        ("/mnt/stacked/a", "tmpfs"),  # of stacked mounts, the later one is on top
    ],
)
def test_file_system_types_come_from_the_mount_table(path: str, fs_type: str) -> None:
    assert files.filesystem_type(Path(path), MOUNTINFO) == fs_type
    assert files.is_memory_fs(Path(path), MOUNTINFO) is (fs_type == "tmpfs")


def test_the_live_mount_table_is_read() -> None:
    if not Path("/proc/self/mountinfo").exists():
        pytest.skip("no /proc/self/mountinfo")
    assert files.filesystem_type(Path("/proc/self")) == "proc"
    assert files.filesystem_type(Path("/nonexistent"), "") is None


def test_mapping_follows_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def mapped(config: StoreConfig) -> dict[str, bool]:
        out = {}
        for tier in build_tiers(config):
            backend = tier.backend
            if isinstance(backend, (DiskBackend, SharedDirBackend)):
                out[tier.name] = backend.mapped
        return out

    dirs = {"local_disk": str(tmp_path / "d"), "max_local_disk_size": 1.0, "shared_dir": str(tmp_path / "s")}
    assert mapped(StoreConfig(**dirs, mmap_reads=True)) == {"disk": True, "fs": True}
    assert mapped(StoreConfig(**dirs, mmap_reads=False)) == {"disk": False, "fs": False}
    on_memory = files.is_memory_fs(tmp_path)
    assert mapped(StoreConfig(**dirs)) == {"disk": on_memory, "fs": on_memory}
    if Path("/dev/shm").is_dir() and files.is_memory_fs(Path("/dev/shm")):
        shm = StoreConfig(shared_dir="/dev/shm/kvmesh-test-never-created")
        assert mapped(shm) == {"fs": True}
    monkeypatch.setenv("KVMESH_MMAP_READS", "false")
    resolved = resolve_config(f"file://{tmp_path / 's'}")
    assert resolved.mmap_reads is False and mapped(resolved) == {"fs": False}
