"""Shared-directory tier (``file://``): one directory used by many processes, NFS style.

No process owns the directory, so nothing is cached about it: every call asks the file system.
Writes are atomic (unique temporary name + rename in the same directory); concurrent writers of
one key both write the same bytes and the last rename wins. Deleting a file another process is
reading is safe on POSIX file systems (the reader keeps its open file or mapping). Files are
mapped, not copied, on a memory-backed file system (``/dev/shm`` shared by one host's replicas) and
copied elsewhere, several at a time (a network file system answers each read after a round trip).
Readers rely on the chunk checksum, never on the file system, to reject a torn or truncated file.
With ``max_bytes`` set, writers keep the directory within that many bytes of chunks
(:mod:`~kvmesh.store.backends.fs_sweep`: oldest written first, pinned chunks never); without it
(the default) size the directory, or expire it, where it is provisioned. Pins:
:mod:`~kvmesh.store.backends.fs_pins` (:attr:`SharedDirBackend.pins`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from kvmesh.errors import TierUnavailableError
from kvmesh.store.backends import files
from kvmesh.store.backends.base import Backend, BackendStats, ChunkData
from kvmesh.store.backends.fs_pins import SharedDirPinLedger
from kvmesh.store.backends.fs_sweep import sweep
from kvmesh.store.keys import StoreKey

T = TypeVar("T")
STALE_TMP_S = 3600.0
READ_THREADS = 4
"""Files read at once by one batch (a network file system answers each read after a round trip)."""
SWEEP_EVERY = 32
"""A writer sweeps after writing 1/32 of the budget since its last sweep (and at its first write)."""


class SharedDirBackend:
    """Chunk files in a directory shared by many processes and hosts.

    Args:
        root: the shared directory (created when missing).
        fsync: fsync each file before it is renamed into place.
        mapped: map files rather than copy them (:func:`files.map_or_none`); default: where the
            directory is memory-backed (``/dev/shm``).
        max_bytes: byte budget of the directory's chunks, kept by sweeps after writes; 0 for none.
    """

    kind = "fs"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: bool = False,
        mapped: bool | None = None,
        max_bytes: int = 0,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.num_evictions = 0
        self._unswept_bytes: int | None = None
        """Bytes written since this process last swept; ``None`` before its first write."""
        self.pins = SharedDirPinLedger(self.root)
        self.fsync = fsync
        self.mapped = files.is_memory_fs(self.root) if mapped is None else mapped
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvmesh-fs-read")
        self._closed = False

    async def _run(self, func: Callable[..., T], *args: object) -> T:
        try:
            return await asyncio.to_thread(func, *args)
        except OSError as exc:
            raise TierUnavailableError(f"shared directory {self.root}: {exc}") from exc

    def _path(self, key: StoreKey) -> Path:
        return files.chunk_path(self.root, key)

    def _exists_all(self, keys: Sequence[StoreKey]) -> list[bool]:
        return [self._path(k).is_file() for k in keys]

    def _read_one(self, key: StoreKey) -> ChunkData | None:
        return files.read_chunk(self._path(key), mapped=self.mapped)

    def _read_all(self, keys: Sequence[StoreKey]) -> list[ChunkData | None]:
        if self.mapped or self._closed or len(keys) < 2:
            # a mapping is made at once (its pages are read later, by the checksum threads)
            return [self._read_one(k) for k in keys]
        return list(self._readers.map(self._read_one, keys))

    def _write_all(self, items: Sequence[tuple[StoreKey, ChunkData]]) -> int:
        for key, value in items:
            files.write_atomic(self._path(key), value, fsync=self.fsync)
        if self.max_bytes:
            self._maybe_sweep(sum(len(v) for _, v in items))
        return len(items)

    def _maybe_sweep(self, written: int) -> None:
        unswept = written + (self._unswept_bytes or 0)
        if self._unswept_bytes is not None and unswept < self.max_bytes // SWEEP_EVERY:
            self._unswept_bytes = unswept
            return
        self._unswept_bytes = 0
        self.num_evictions += sweep(self.root, self.max_bytes).num_evicted

    def _unlink_all(self, keys: Sequence[StoreKey]) -> int:
        return sum(files.unlink_quiet(self._path(k)) for k in keys)

    def _flush(self, group: str | None) -> int:
        removed = sum(files.unlink_quiet(path) for _, path, _ in files.scan(self.root, group))
        if group is None:
            files.remove_temporaries(self.root, older_than_s=STALE_TMP_S, now=time.time())
        return removed

    def _stats(self) -> BackendStats:
        num_chunks = num_bytes = 0
        for _, _, st in files.scan(self.root):
            num_chunks += 1
            num_bytes += st.st_size
        return BackendStats(
            kind=self.kind,
            num_chunks=num_chunks,
            num_bytes=num_bytes,
            capacity_bytes=self.max_bytes,
            num_evictions=self.num_evictions,
            extra={"root": str(self.root)},
        )

    async def exists_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        return await self._run(self._exists_all, list(keys))

    async def get_many(self, keys: Sequence[StoreKey]) -> list[ChunkData | None]:
        return await self._run(self._read_all, list(keys))

    async def put_many(self, items: Sequence[tuple[StoreKey, ChunkData]]) -> int:
        return await self._run(self._write_all, list(items))

    async def delete_many(self, keys: Sequence[StoreKey]) -> int:
        return await self._run(self._unlink_all, list(keys))

    async def flush(self, group: str | None = None) -> int:
        return await self._run(self._flush, group)

    async def stats(self) -> BackendStats:
        return await self._run(self._stats)

    async def aclose(self) -> None:
        self._closed = True
        self._readers.shutdown(wait=False)


_check: type[Backend] = SharedDirBackend
