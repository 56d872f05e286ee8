"""Local disk tier: a directory of chunk files under a byte budget, LRU, owned by one process.

The process keeps an in-memory index (key → size, in LRU order) so ``exists_many`` costs no I/O.
At start the index is rebuilt from the directory (oldest modification time first); temporary files
left by an interrupted write are deleted, and files that are not chunk files are ignored, so a
restart keeps every complete chunk. File I/O runs in worker threads, never on the event loop.

Writes, deletes and evictions run one batch at a time (file operations on one key must not
overtake each other in the thread pool); reads run concurrently with them. Space is reserved and
evictions are decided before a write starts, so the bytes on disk never exceed the budget. A key
enters the index only once its file is in place, so readers never see a half-written key.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from kvmesh.errors import TierUnavailableError
from kvmesh.store.backends import files
from kvmesh.store.backends.base import Backend, BackendStats, ChunkData
from kvmesh.store.backends.changes import ChangeLog, ChunksChanged, Watchable
from kvmesh.store.keys import StoreKey

T = TypeVar("T")


class DiskBackend:
    """Bounded LRU of chunk files in ``root``.

    Args:
        root: directory (created when missing). One process owns it; use
            :class:`~kvmesh.store.backends.fs.SharedDirBackend` for a directory shared by many.
        capacity_bytes: byte budget for chunk files (> 0).
        fsync: fsync each file before it is renamed into place (durable across power loss).
        mapped: map chunk files rather than copy them (:func:`files.map_or_none`); default: where
            the directory is memory-backed (a disk's I/O error under a mapping ends the process).
        on_change: told what each call stored and dropped (:mod:`~kvmesh.store.backends.changes`);
            chunks found in the directory at start are not reported as stored.
    """

    kind = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        fsync: bool = False,
        mapped: bool | None = None,
        on_change: ChunksChanged | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.mapped = files.is_memory_fs(self.root) if mapped is None else mapped
        self.on_change = on_change
        self.num_evictions = 0
        self._index: OrderedDict[StoreKey, int] = OrderedDict()
        self._num_bytes = 0
        self._reserved = 0
        self._generation = 0
        self._mutation = asyncio.Lock()
        self._loaded: asyncio.Future[None] | None = None

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    async def _ensure_loaded(self) -> None:
        """Rebuild the index from the directory once; concurrent callers wait for the first."""
        while True:
            if self._loaded is None:
                break
            if self._loaded.done():
                return
            await asyncio.shield(self._loaded)
        loading: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._loaded = loading
        try:
            found = await asyncio.to_thread(self._scan)
        except OSError as exc:
            self._loaded = None
            loading.set_result(None)
            raise TierUnavailableError(f"disk tier {self.root}: cannot read index: {exc}") from exc
        for key, size in found:
            if key not in self._index:
                self._index[key] = size
                self._num_bytes += size
        doomed = self._evict_for(0)
        try:
            if doomed:
                self._report_dropped(doomed)
                await self._run(self._unlink_all, doomed)
        finally:
            loading.set_result(None)

    def _scan(self) -> list[tuple[StoreKey, int]]:
        self.root.mkdir(parents=True, exist_ok=True)
        files.remove_temporaries(self.root)
        entries = [(st.st_mtime_ns, key, st.st_size) for key, _, st in files.scan(self.root)]
        entries.sort(key=lambda e: e[0])
        return [(key, size) for _, key, size in entries]

    async def _run(self, func: Callable[..., T], *args: object) -> T:
        try:
            return await asyncio.to_thread(func, *args)
        except OSError as exc:
            raise TierUnavailableError(f"disk tier {self.root}: {exc}") from exc

    def _evict_for(self, incoming: int) -> list[StoreKey]:
        doomed: list[StoreKey] = []
        while self._index and self._num_bytes + incoming > self.capacity_bytes:
            key, size = self._index.popitem(last=False)
            self._num_bytes -= size
            self.num_evictions += 1
            doomed.append(key)
        return doomed

    def _report_dropped(self, keys: Sequence[StoreKey]) -> None:
        if self.on_change is not None and keys:
            log = ChangeLog()
            for key in keys:
                log.dropped(key)
            log.report(self.on_change)

    def _unlink_all(self, keys: list[StoreKey]) -> int:
        return sum(files.unlink_quiet(files.chunk_path(self.root, k)) for k in keys)

    def _read_all(self, keys: list[StoreKey]) -> list[ChunkData | None]:
        return [files.read_chunk(files.chunk_path(self.root, k), mapped=self.mapped) for k in keys]

    def _write_all(self, doomed: list[StoreKey], items: list[tuple[StoreKey, ChunkData]]) -> None:
        self._unlink_all(doomed)
        for key, value in items:
            files.write_atomic(files.chunk_path(self.root, key), value, fsync=self.fsync)

    async def exists_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        await self._ensure_loaded()
        return [k in self._index for k in keys]

    async def get_many(self, keys: Sequence[StoreKey]) -> list[ChunkData | None]:
        await self._ensure_loaded()
        wanted = [k for k in keys if k in self._index]
        if not wanted:
            return [None] * len(keys)
        generation = self._generation
        values = dict(zip(wanted, await self._run(self._read_all, wanted), strict=True))
        out: list[ChunkData | None] = []
        vanished: list[StoreKey] = []
        for key in keys:
            value = values.get(key)
            if value is None and key in values and generation == self._generation:
                # The index listed a file that is gone (deleted behind our back): forget it.
                size = self._index.pop(key, None)
                if size is not None:
                    self._num_bytes -= size
                    vanished.append(key)
            elif key in self._index:
                self._index.move_to_end(key)
            out.append(value)
        self._report_dropped(vanished)
        return out

    @contextlib.asynccontextmanager
    async def _mutating(self) -> AsyncIterator[None]:
        """Held while a write or delete changes the index; the generation moves on both sides so a
        read that overlapped it does not take a file it changed for one removed behind our back."""
        await self._ensure_loaded()
        async with self._mutation:
            self._generation += 1
            try:
                yield
            finally:
                self._generation += 1

    async def put_many(self, items: Sequence[tuple[StoreKey, ChunkData]]) -> int:
        async with self._mutating():
            return await self._put_locked(items)

    async def _put_locked(self, items: Sequence[tuple[StoreKey, ChunkData]]) -> int:
        log = None if self.on_change is None else ChangeLog()
        accepted: list[tuple[StoreKey, ChunkData]] = []
        doomed: list[StoreKey] = []
        for key, value in items:
            size = len(value)
            old = self._index.pop(key, None)
            if old is not None:
                self._num_bytes -= old
                doomed.append(key)
            evicted = self._evict_for(size + self._reserved)
            doomed.extend(evicted)
            if log is not None:
                for gone in [key, *evicted] if old is not None else evicted:
                    log.dropped(gone)
            if self._num_bytes + self._reserved + size > self.capacity_bytes:
                continue
            self._reserved += size
            accepted.append((key, value))
        written = {k for k, _ in accepted}
        reserved = sum(len(v) for _, v in accepted)
        try:
            try:
                await self._run(self._write_all, [k for k in doomed if k not in written], accepted)
            except TierUnavailableError:
                await asyncio.to_thread(self._unlink_quietly, [k for k, _ in accepted])
                raise
            finally:
                self._reserved -= reserved
            for key, value in accepted:
                old = self._index.pop(key, None)
                if old is not None:
                    self._num_bytes -= old
                self._index[key] = len(value)
                self._num_bytes += len(value)
                if log is not None:
                    log.wrote(key, held_before=old is not None)
        finally:
            # A failed write still dropped what it evicted.
            if log is not None:
                log.report(self.on_change)
        return len(accepted)

    def _unlink_quietly(self, keys: list[StoreKey]) -> None:
        for key in keys:
            try:
                files.unlink_quiet(files.chunk_path(self.root, key))
            except OSError:
                continue

    async def delete_many(self, keys: Sequence[StoreKey]) -> int:
        async with self._mutating():
            return await self._delete_locked(keys)

    async def _delete_locked(self, keys: Sequence[StoreKey]) -> int:
        present = []
        for key in keys:
            size = self._index.pop(key, None)
            if size is not None:
                self._num_bytes -= size
                present.append(key)
        self._report_dropped(present)
        if present:
            await self._run(self._unlink_all, present)
        return len(present)

    async def flush(self, group: str | None = None) -> int:
        await self._ensure_loaded()
        doomed = [k for k in self._index if group is None or k.group == group]
        return await self.delete_many(doomed)

    async def stats(self) -> BackendStats:
        await self._ensure_loaded()
        return BackendStats(
            kind=self.kind,
            num_chunks=len(self._index),
            num_bytes=self._num_bytes,
            capacity_bytes=self.capacity_bytes,
            num_evictions=self.num_evictions,
            extra={"root": str(self.root)},
        )

    def disk_usage_bytes(self) -> int:
        """Bytes of chunk files actually on disk (blocking; for tests and tools)."""
        return sum(st.st_size for _, _, st in files.scan(self.root))

    async def aclose(self) -> None:
        self._index.clear()
        self._num_bytes = 0
        self._loaded = None


_check: type[Backend] = DiskBackend
_watchable: type[Watchable] = DiskBackend
