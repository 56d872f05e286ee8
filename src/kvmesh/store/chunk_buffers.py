"""Byte buffers of encoded chunks, recycled by the RAM tier.

A fresh 32 MiB buffer costs the kernel one page fault and one zeroed page per 4 KiB before the
first byte is copied in: more than the copy itself. A RAM tier at its budget drops one chunk for
each it stores, and chunks of one model are all the same size, so the dropped chunk's buffer is
handed to the next encode instead of going back to the allocator.

A buffer is only reused once nothing else refers to it: a reader's zero-copy view of a chunk, or a
slower tier's queued write of it, keeps the buffer waiting (set aside, counted against the pool's
room) until it lets go; an encode that finds no free buffer of its size takes one that has been
let go since.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

_UNSHARED_REFS = 3
"""References to a buffer nobody else holds, as :func:`sys.getrefcount` counts them: inside
:meth:`ChunkBuffers.give`, the caller's one local name, the argument and getrefcount's own
argument; for a waiting buffer, its list slot, the loop's one name and getrefcount's argument."""


class ChunkBuffers:
    """Free buffers by exact size, holding at most what ``room()`` allows.

    Args:
        room: bytes the pool may hold now (the RAM tier passes its unused budget, so pooled and
            stored chunks together stay within it).
    """

    def __init__(self, room: Callable[[], int]) -> None:
        self._room = room
        self._free: dict[int, list[bytearray]] = {}
        self._waiting: list[bytearray] = []
        # encodes may run on worker threads while the tier gives buffers back on the event loop
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.num_reused = 0
        self.num_allocated = 0

    def take(self, size: int) -> bytearray:
        """A writable buffer of ``size`` bytes: a recycled one when the pool has that size (its old
        contents are left in place: the caller overwrites every byte)."""
        with self._lock:
            free = self._free.get(size)
            if free:
                self.num_bytes -= size
                self.num_reused += 1
                return free.pop()
            for n in range(len(self._waiting)):  # not enumerate: its reused tuple holds one more
                buf = self._waiting[n]
                if len(buf) == size and sys.getrefcount(buf) <= _UNSHARED_REFS:
                    del self._waiting[n]
                    self.num_bytes -= size
                    self.num_reused += 1
                    return buf
            self.num_allocated += 1
        return bytearray(size)

    def give(self, buf: bytearray) -> bool:
        """Take ``buf`` back unless the pool is full: free, or waiting while something else still
        refers to it. Returns whether it was taken.

        The caller must hold ``buf`` under exactly one local name and drop it afterwards.
        """
        unshared = sys.getrefcount(buf) <= _UNSHARED_REFS
        size = len(buf)
        with self._lock:
            if self.num_bytes + size > self._room():
                return False
            if unshared:
                self._free.setdefault(size, []).append(buf)
            else:
                self._waiting.append(buf)
            self.num_bytes += size
        return True

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._waiting.clear()
            self.num_bytes = 0
