"""Pins in the shared directory: one marker file per pinned chunk, its mtime the pin's deadline.

::

    <root>/.pins/<tenant id>/.lock                 flock: one pin or check of a tenant at a time
    <root>/.pins/<tenant id>/<group>.<chunk hex>   a pin: size = bytes pinned, mtime = deadline

A marker is a sparse file whose length is the chunk's size: it takes no data blocks, and one
``stat`` (which the directory scan makes anyway for the deadline) gives both figures, so a tenant's
usage costs two ``stat`` calls per live pin (the marker's and its chunk's) and no reads.

The directory's sweeper (:mod:`kvmesh.store.backends.fs_sweep`) never evicts a chunk with a live
marker. A marker whose deadline passed, or whose chunk file is gone (flushed, deleted as corrupt),
is removed at the tenant's next pin and ignored by the sweeper meanwhile: the chunk is ordinary
data again. Every process sharing the directory reads the same markers, so they share the budget;
``flock`` serializes a tenant's pins on one host and on NFSv4 (where locks are forwarded to the
server), not on file systems that ignore locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from kvmesh.core.hashing import hex_key
from kvmesh.errors import TierUnavailableError
from kvmesh.store.backends import files
from kvmesh.store.keys import StoreKey
from kvmesh.store.pins import PinLedger, PinOutcome, PinRequest, tenant_id

PINS_DIR = ".pins"
_LOCK = ".lock"


def marker_name(key: StoreKey) -> str:
    """A pin marker's file name: ``<group>.<chunk hex>``."""
    return f"{key.group}.{hex_key(key.chunk)}"


def chunk_path_of_marker(root: Path, name: str) -> Path | None:
    """The chunk file a marker name stands for; ``None`` for a foreign name."""
    group, sep, chunk = name.partition(".")
    if not sep:
        return None
    try:
        key = StoreKey.parse(f"{group}/{chunk}")
    except ValueError:
        return None
    return files.chunk_path(root, key)


def live_markers(tenant_dir: Path, now: float) -> Iterator[tuple[str, os.stat_result]]:
    """The markers of one tenant whose deadline is after ``now``."""
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(tenant_dir):
            if entry.name.startswith("."):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat(follow_symlinks=False)
                if st.st_mtime > now:
                    yield entry.name, st


def pinned_names(root: Path, now: float) -> set[str]:
    """Marker names (``<group>.<chunk hex>``) of every tenant's live pins."""
    names: set[str] = set()
    with contextlib.suppress(FileNotFoundError):
        for tenant in os.scandir(root / PINS_DIR):
            if tenant.is_dir(follow_symlinks=False):
                names.update(name for name, _ in live_markers(Path(tenant.path), now))
    return names


def is_pinned(root: Path, name: str, now: float) -> bool:
    """Whether any tenant holds a live pin on the chunk ``name`` (checked on disk, now)."""
    with contextlib.suppress(FileNotFoundError):
        for tenant in os.scandir(root / PINS_DIR):
            if not tenant.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(FileNotFoundError):
                if os.stat(Path(tenant.path) / name).st_mtime > now:
                    return True
    return False


def _write_marker(path: Path, size: int, deadline: float) -> None:
    """A sparse file of ``size`` bytes with mtime ``deadline``, put in place by a rename."""
    tmp = path.parent / f"{files.TMP_PREFIX}{os.getpid()}-{path.name}"
    with open(tmp, "wb") as f:
        f.truncate(size)
    os.utime(tmp, (deadline, deadline))
    os.replace(tmp, path)


class SharedDirPinLedger:
    """Pins of one shared directory.

    Args:
        root: the shared directory.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pins_dir = root / PINS_DIR

    def _usage(self, tenant_dir: Path, now: float) -> dict[str, int]:
        """The tenant's live pins and their bytes; expired and orphaned markers are removed."""
        live: dict[str, int] = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(tenant_dir):
                if entry.name.startswith("."):
                    continue
                path = Path(entry.path)
                chunk = chunk_path_of_marker(self.root, entry.name)
                try:
                    st = entry.stat(follow_symlinks=False)
                    expired, size = st.st_mtime <= now, st.st_size
                except FileNotFoundError:
                    expired, size = True, 0
                if expired or chunk is None or not chunk.is_file():
                    files.unlink_quiet(path)
                    continue
                live[entry.name] = size
        return live

    def _pin(self, request: PinRequest) -> PinOutcome:
        budget, estimate = request.budget_bytes, request.estimate_bytes
        tenant_dir = self.pins_dir / tenant_id(request.tenant)
        tenant_dir.mkdir(parents=True, exist_ok=True)
        with open(tenant_dir / _LOCK, "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            now = time.time()
            deadline = now + request.ttl_s
            live = self._usage(tenant_dir, now)
            used = sum(live.values())
            added = pinned = missing = 0
            sizes: dict[str, int] = {}
            for key in dict.fromkeys(request.keys):
                name = marker_name(key)
                try:
                    size = files.chunk_path(self.root, key).stat().st_size
                except FileNotFoundError:
                    missing += 1
                    if estimate is not None:
                        added += estimate
                        pinned += 1
                    continue
                pinned += 1
                sizes[name] = size
                if name not in live:
                    added += size
            if used + added > budget:
                return PinOutcome("fs", False, pinned, missing, used, added, budget, 0.0)
            if estimate is not None:
                return PinOutcome("fs", True, pinned, missing, used, added, budget, 0.0)
            for name, size in sizes.items():
                marker = tenant_dir / name
                if name not in live:
                    _write_marker(marker, size, deadline)
                elif marker.stat().st_mtime < deadline:
                    os.utime(marker, (deadline, deadline))
            return PinOutcome("fs", True, pinned, missing, used + added, added, budget, deadline)

    def _release(self) -> int:
        now = time.time()
        released = 0
        with contextlib.suppress(FileNotFoundError):
            for tenant in os.scandir(self.pins_dir):
                if not tenant.is_dir(follow_symlinks=False):
                    continue
                for entry in os.scandir(tenant.path):
                    if entry.name.startswith("."):
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        if entry.stat(follow_symlinks=False).st_mtime <= now:
                            released += files.unlink_quiet(Path(entry.path))
        return released

    async def pin_many(self, request: PinRequest) -> PinOutcome:
        try:
            return await asyncio.to_thread(self._pin, request)
        except OSError as exc:
            raise TierUnavailableError(f"shared directory {self.root}: pin failed: {exc}") from exc

    async def release_expired(self) -> int:
        try:
            return await asyncio.to_thread(self._release)
        except OSError as exc:
            raise TierUnavailableError(f"shared directory {self.root}: pin release failed: {exc}") from exc


_check: type[PinLedger] = SharedDirPinLedger
