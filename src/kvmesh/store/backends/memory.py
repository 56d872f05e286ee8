"""In-process RAM tier: an LRU of encoded chunks under a byte budget, pinned chunks passed over."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.store.backends.base import Backend, BackendStats, ChunkData
from kvmesh.store.backends.changes import ChangeLog, ChunksChanged, Watchable
from kvmesh.store.backends.memory_pins import MemoryPinLedger
from kvmesh.store.chunk_buffers import ChunkBuffers
from kvmesh.store.keys import StoreKey


class MemoryBackend:
    """LRU of encoded chunks, bounded by the sum of their lengths.

    Runs on the caller's event loop with no locks: every method completes without awaiting.
    A ``get`` or ``put`` makes the key most recently used; inserting evicts from the least
    recently used end until the new item fits, passing over pinned chunks (:attr:`pins`; when only
    pinned chunks are left, the new item is not stored). An item larger than the whole budget is
    refused.
    Values are kept as given when they are ``bytes``; a ``bytearray`` (an encode into
    :attr:`buffers`) is taken over: the caller must not change it afterwards. Other values are
    copied (a view may change, or map a file). Reads hand out read-only views of taken-over buffers,
    and a dropped chunk's buffer goes back to :attr:`buffers` once nothing refers to it.

    Args:
        capacity_bytes: byte budget (> 0).
        on_change: told what each call stored and dropped (:mod:`~kvmesh.store.backends.changes`).
    """

    kind = "memory"

    def __init__(self, capacity_bytes: int, *, on_change: ChunksChanged | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.on_change = on_change
        self._entries: OrderedDict[StoreKey, bytes | bytearray] = OrderedDict()
        self._num_bytes = 0
        self.buffers = ChunkBuffers(lambda: self.capacity_bytes - self._num_bytes)
        """Buffers of dropped chunks, for the next encodes (pooled and stored chunks stay within the
        budget, plus at most the one chunk a put is storing)."""
        self.num_evictions = 0
        self.pins = MemoryPinLedger(self._size_of)
        """Pins of this tier (best effort: this process's, kept while they fit)."""

    def _size_of(self, key: StoreKey) -> int | None:
        value = self._entries.get(key)
        return None if value is None else len(value)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def keys_lru_order(self) -> list[StoreKey]:
        """Keys from least to most recently used."""
        return list(self._entries)

    async def exists_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        return [k in self._entries for k in keys]

    async def get_many(self, keys: Sequence[StoreKey]) -> list[ChunkData | None]:
        out: list[ChunkData | None] = []
        for key in keys:
            value = self._entries.get(key)
            if value is None:
                out.append(None)
                continue
            self._entries.move_to_end(key)
            out.append(memoryview(value).toreadonly() if isinstance(value, bytearray) else value)
        return out

    async def put_many(self, items: Sequence[tuple[StoreKey, ChunkData]]) -> int:
        log = None if self.on_change is None else ChangeLog()
        stored = 0
        for key, value in items:
            size = len(value)
            old = self._entries.pop(key, None)
            if old is not None:
                self._num_bytes -= len(old)
                if isinstance(old, bytearray) and old is not value:
                    self.buffers.give(old)
            if size > self.capacity_bytes:
                if old is not None and log is not None:
                    log.dropped(key)
                continue
            pinned = self.pins.holds if len(self.pins) else None
            passed = 0
            while self._num_bytes + size > self.capacity_bytes and passed < len(self._entries):
                gone, evicted = self._entries.popitem(last=False)
                if pinned is not None and pinned(gone):
                    self._entries[gone] = evicted
                    passed += 1
                    continue
                self._num_bytes -= len(evicted)
                self.num_evictions += 1
                if isinstance(evicted, bytearray):
                    self.buffers.give(evicted)
                if log is not None:
                    log.dropped(gone)
            if self._num_bytes + size > self.capacity_bytes:
                # only pinned chunks are left: they stay, this one is not stored
                self.pins.forget([key])
                if old is not None and log is not None:
                    log.dropped(key)
                continue
            self._entries[key] = value if isinstance(value, bytes | bytearray) else bytes(value)
            self._num_bytes += size
            stored += 1
            if log is not None:
                log.wrote(key, held_before=old is not None)
        if log is not None:
            log.report(self.on_change)
        return stored

    async def delete_many(self, keys: Sequence[StoreKey]) -> int:
        log = None if self.on_change is None else ChangeLog()
        removed = 0
        for key in keys:
            value = self._entries.pop(key, None)
            if value is not None:
                self._num_bytes -= len(value)
                removed += 1
                if isinstance(value, bytearray):
                    self.buffers.give(value)
                self.pins.forget([key])
                if log is not None:
                    log.dropped(key)
        if log is not None:
            log.report(self.on_change)
        return removed

    async def flush(self, group: str | None = None) -> int:
        doomed = [k for k in self._entries if group is None or k.group == group]
        return await self.delete_many(doomed)

    async def stats(self) -> BackendStats:
        return BackendStats(
            kind=self.kind,
            num_chunks=len(self._entries),
            num_bytes=self._num_bytes,
            capacity_bytes=self.capacity_bytes,
            num_evictions=self.num_evictions,
        )

    async def aclose(self) -> None:
        self._entries.clear()
        self._num_bytes = 0
        self.buffers.clear()


_check: type[Backend] = MemoryBackend
_watchable: type[Watchable] = MemoryBackend
