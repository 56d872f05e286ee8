"""Virtual time: a heap of timed callbacks.

Nothing here sleeps or touches a socket. Time is a float number of simulated seconds and only
moves when the loop pops the next event, so a run is a pure function of its inputs and seed.
Ties are broken by insertion order, which keeps runs reproducible bit for bit.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Callback = Callable[..., None]


class EventLoop:
    """Runs callbacks in order of their virtual due time.

    Callbacks cannot be cancelled; a component that may need to take back a scheduled wake-up
    keeps a version counter and ignores stale ones (cheaper than heap removal).
    """

    __slots__ = ("_heap", "_seq", "now", "num_events")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callback, tuple[Any, ...]]] = []
        self._seq = 0
        self.now = 0.0
        """Current virtual time in seconds."""
        self.num_events = 0
        """Callbacks run so far."""

    def call_at(self, when: float, callback: Callback, *args: Any) -> None:
        """Run ``callback(*args)`` at virtual time ``when``.

        Raises:
            ValueError: ``when`` lies in the past.
        """
        if when < self.now:
            raise ValueError(f"cannot schedule at t={when!r}, the clock is already at {self.now!r}")
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, callback, args))

    def call_later(self, delay: float, callback: Callback, *args: Any) -> None:
        """Run ``callback(*args)`` after ``delay`` virtual seconds (``delay`` ≥ 0)."""
        self.call_at(self.now + delay, callback, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None) -> None:
        """Run events until none is left, or until the next one is due after ``until``.

        With ``until`` set, the clock ends at ``until`` even if the heap empties earlier.
        """
        heap = self._heap
        pop = heapq.heappop
        count = 0
        try:
            while heap:
                if until is not None and heap[0][0] > until:
                    break
                when, _, callback, args = pop(heap)
                self.now = when
                count += 1
                callback(*args)
        finally:
            self.num_events += count
        if until is not None and until > self.now:
            self.now = until
