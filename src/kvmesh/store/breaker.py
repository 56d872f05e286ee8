"""Circuit breaker with exponential reconnect backoff, one per tier.

::

     closed ──(failure_threshold consecutive failures)──► open
       ▲                                                  │ backoff elapsed
       │ probe succeeds                                   ▼
       └──────────────────────────────────────────── half_open ──(probe fails: backoff × 2)──► open

While open, calls are refused without touching the tier (they cost nothing). After the backoff one
call is let through as a probe; its outcome closes the breaker or reopens it with a doubled backoff
(capped at ``max_backoff_s``). Single-threaded: used from one event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import IntEnum


class BreakerState(IntEnum):
    """Numeric values are what the ``kvmesh_store_breaker_state`` gauge reports."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """Decides whether a tier may be called.

    Args:
        failure_threshold: consecutive failures that open the breaker (≥ 1).
        backoff_s: first open period.
        max_backoff_s: cap of the doubling open period.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        failure_threshold: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be ≥ 1, got {failure_threshold}")
        if backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError(f"need 0 < backoff_s ≤ max_backoff_s, got {backoff_s}, {max_backoff_s}")
        self.failure_threshold = failure_threshold
        self.base_backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.num_failures = 0
        self.num_opens = 0
        self.num_rejected = 0
        self._backoff_s = backoff_s
        self._open_until = 0.0
        self._probe_in_flight = False

    def allow(self) -> bool:
        """Whether a call may go to the tier now. A ``True`` in half-open state is the probe."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if self._clock() < self._open_until:
                self.num_rejected += 1
                return False
            self.state = BreakerState.HALF_OPEN
            self._probe_in_flight = False
        if self._probe_in_flight:
            self.num_rejected += 1
            return False
        self._probe_in_flight = True
        return True

    def record_success(self) -> None:
        self.num_failures = 0
        self._probe_in_flight = False
        if self.state is not BreakerState.CLOSED:
            self.state = BreakerState.CLOSED
            self._backoff_s = self.base_backoff_s

    def record_failure(self) -> None:
        self.num_failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)
            self._open()
        elif self.state is BreakerState.CLOSED and self.num_failures >= self.failure_threshold:
            self._open()

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self.num_opens += 1
        self._probe_in_flight = False
        self._open_until = self._clock() + self._backoff_s

    @property
    def retry_in_s(self) -> float:
        """Seconds until the next probe is allowed (0 when not open)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._open_until - self._clock())
