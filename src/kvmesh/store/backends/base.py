"""The backend interface every tier implements.

Contract shared by all backends (checked by ``tests/store/test_store_backends.py`` against each):

- Batch-first: every call takes a sequence of keys and answers per key, in order.
- Values are opaque bytes (encoded chunks); a backend never interprets them. A value read back may
  be a read-only ``memoryview`` (the file tiers map files rather than copy them).
- A miss is ``False`` / ``None`` in the answer, never an exception.
- A backend that cannot do its job (server down, disk I/O error) raises
  :class:`~kvmesh.errors.TierUnavailableError`, chained from the underlying error; third-party
  exceptions never leave a backend.
- ``put_many`` may store fewer items than given (a byte budget too small for an item) and says so
  in its return value; an existing key is overwritten.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

from kvmesh.store.keys import StoreKey

ChunkData = bytes | bytearray | memoryview
"""An encoded chunk as a backend hands it out or takes it in (a ``bytearray``: one encoded into a
buffer the RAM tier recycles, :mod:`kvmesh.store.chunk_buffers`)."""


@dataclass(slots=True)
class BackendStats:
    """Counters and sizes a backend reports about itself."""

    kind: str
    num_chunks: int = 0
    """Chunks held; -1 when the backend cannot count them cheaply (shared tiers)."""
    num_bytes: int = 0
    """Bytes held; -1 when unknown."""
    capacity_bytes: int = 0
    """Byte budget; 0 means the backend does not enforce one."""
    num_evictions: int = 0
    extra: dict[str, float | int | str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """Every field by name, with ``extra``'s entries in place of ``extra``."""
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return out | self.extra


class Backend(Protocol):
    """An async key → bytes store for encoded chunks."""

    kind: str
    """"memory", "disk", "redis" or "fs"."""

    async def exists_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each key is held."""
        ...

    async def get_many(self, keys: Sequence[StoreKey]) -> list[ChunkData | None]:
        """Each key's value, or ``None`` when it is not held."""
        ...

    async def put_many(self, items: Sequence[tuple[StoreKey, ChunkData]]) -> int:
        """Store the items; returns how many were stored."""
        ...

    async def delete_many(self, keys: Sequence[StoreKey]) -> int:
        """Delete the keys; returns how many existed."""
        ...

    async def flush(self, group: str | None = None) -> int:
        """Delete every chunk of ``group`` (every chunk when ``None``); returns how many."""
        ...

    async def stats(self) -> BackendStats:
        """Sizes and counters."""
        ...

    async def aclose(self) -> None:
        """Release connections and threads; the backend is unusable afterwards."""
        ...
