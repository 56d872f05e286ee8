"""Intervals of the router's periodic probes that stretch while its endpoints are idle.

Health checks and metrics scrapes keep the router's view fresh while requests flow. With no
traffic there is nothing to route, so each quiet round doubles the wait (up to a cap), and the
first request afterwards puts it back to the base interval and wakes the probe at once: an idle
fleet is not woken several times a second per engine, and a busy one is probed as configured.
"""

from __future__ import annotations

import asyncio
import contextlib

IDLE_MAX_INTERVAL_S = 8.0
"""Longest wait between probes of an idle fleet."""
IDLE_MAX_STRETCH = 16
"""An idle wait grows to at most this many times the configured interval (8 s from the 0.5 s
health-check default), so a short interval chosen for quick failure detection stays short."""


class IdleBackoff:
    """The wait before a probe's next round.

    Args:
        base_s: the configured interval, used while anything is busy.
        max_s: the cap the interval doubles up to while everything is idle (at least ``base_s``);
            by default the smaller of :data:`IDLE_MAX_INTERVAL_S` and :data:`IDLE_MAX_STRETCH` times
            ``base_s``.
    """

    def __init__(self, base_s: float, max_s: float | None = None) -> None:
        if base_s < 0:
            raise ValueError(f"probe interval must not be negative, got {base_s}")
        if max_s is None:
            max_s = min(IDLE_MAX_INTERVAL_S, IDLE_MAX_STRETCH * base_s)
        self.base_s = base_s
        self.max_s = max(max_s, base_s)
        self.interval_s = base_s
        self._woken = asyncio.Event()

    def note_activity(self) -> None:
        """A request is on its way: probe at the base interval again, starting now."""
        if self.interval_s > self.base_s:
            self.interval_s = self.base_s
            self._woken.set()

    async def wait(self, *, busy: bool) -> None:
        """Sleep until the next round: the base interval after a busy round, else twice the last
        wait (capped); a :meth:`note_activity` ends a stretched wait early."""
        self.interval_s = self.base_s if busy else min(self.interval_s * 2, self.max_s)
        if self.interval_s <= self.base_s:
            await asyncio.sleep(self.interval_s)
            return
        self._woken.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._woken.wait(), self.interval_s)
