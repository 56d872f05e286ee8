"""One daemon thread that handles queued items in order: the loader's and the saver's worker."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["SerialThread"]

T = TypeVar("T")


class SerialThread(Generic[T]):
    """Runs ``handle(item)`` for each :meth:`put` item on one daemon thread, in put order.

    Args:
        handle: what to do with one item; it must not raise (the thread would end with it).
        name: the thread's name.
    """

    def __init__(self, handle: Callable[[T], None], name: str) -> None:
        self._handle = handle
        self._queue: queue.SimpleQueue[T | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, item: T) -> None:
        """Queue ``item`` behind those put before it."""
        self._queue.put(item)

    def close(self, timeout_s: float) -> None:
        """Handle the queued items, then stop the thread (waits at most ``timeout_s``)."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            self._handle(item)
