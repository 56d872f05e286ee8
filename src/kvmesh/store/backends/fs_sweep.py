"""The shared directory's byte budget: least recently written chunks go first, pinned ones never.

Any process writing to the directory may sweep it (blocking; run it in a thread). One sweep at a
time per directory (a non-blocking ``flock``; a writer that finds a sweep running skips its own).
A sweep lists every chunk file, and when their bytes exceed the budget unlinks the oldest by mtime
until they fit, skipping chunks with a live pin marker (:mod:`kvmesh.store.backends.fs_pins`); a
candidate's pin is checked again just before its unlink, so a pin taken during the sweep holds.
Pins may keep the directory over its budget: the pin budgets bound them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvmesh.store.backends import files
from kvmesh.store.backends.fs_pins import is_pinned, marker_name, pinned_names

_SWEEP_LOCK = ".kvmesh-sweep.lock"


@dataclass(slots=True)
class SweepResult:
    """What one sweep found and did."""

    num_bytes: int
    """Chunk bytes in the directory after the sweep."""
    num_evicted: int
    num_pinned_kept: int
    """Pinned chunks passed over while evicting."""
    swept: bool
    """False when another process was sweeping (nothing was done)."""


def sweep(root: Path, max_bytes: int, now: float | None = None) -> SweepResult:
    """Evict unpinned chunks, oldest written first, until the directory holds ``max_bytes`` or less.

    Args:
        root: the shared directory.
        max_bytes: the budget (positive).
        now: the time pins are judged at (default: the clock).
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / _SWEEP_LOCK, "a") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return SweepResult(-1, 0, 0, swept=False)
        when = time.time() if now is None else now
        chunks = [(st.st_mtime, st.st_size, key, path) for key, path, st in files.scan(root)]
        total = sum(size for _, size, _, _ in chunks)
        if total <= max_bytes:
            return SweepResult(total, 0, 0, swept=True)
        pinned = pinned_names(root, when)
        chunks.sort(key=lambda c: c[0])
        evicted = kept = 0
        for _, size, key, path in chunks:
            if total <= max_bytes:
                break
            name = marker_name(key)
            if name in pinned or is_pinned(root, name, when):
                kept += 1
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                evicted += 1
            total -= size
        return SweepResult(total, evicted, kept, swept=True)
