"""How long each phase lasts (quick or full run) and the log of faults as time spans.

All times are seconds on the harness clock (``time.perf_counter()`` minus the run's start), the
clock the load's results use too, so faults and requests line up on the timeline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Durations:
    """Phase lengths and sizes of one run mode."""

    baseline_s: float
    """Steady load before a fault, the reference for added latency."""
    outage_s: float
    """How long the shared tier stays dead (and, separately, frozen)."""
    recover_s: float
    """Load after a fault is lifted, over which recovery is measured."""
    soak_s: float
    soak_warmup_s: float
    """Leading part of the soak whose growth does not count (caches filling)."""
    capacity_probe_s: float
    corrupt_chunks: int
    event_frames: int
    http_cases: int
    http_concurrency: int = 8
    overload_burst_s: float = 4.0
    """The overload scenario's burst at three times capacity."""
    rss_growth_bound: float = 0.05
    """Largest RSS growth any process may show after the soak's warm-up (a share)."""

    def __post_init__(self) -> None:
        if self.soak_warmup_s >= self.soak_s:
            raise ValueError(
                f"soak warm-up ({self.soak_warmup_s} s) must be shorter than the soak ({self.soak_s} s)"
            )


QUICK = Durations(
    baseline_s=3.0,
    outage_s=4.0,
    recover_s=5.0,
    soak_s=30.0,
    soak_warmup_s=10.0,
    capacity_probe_s=4.0,
    corrupt_chunks=1_000,
    event_frames=5_000,
    http_cases=500,
    # 20 s of samples tell a leak from nothing: one allocator step decides them (the quick runs of
    # one day: Redis's RSS +10.3 % in one, +0.2 % and +2.0 % in two others). The full run's 9
    # minutes hold the 5 % bound.
    rss_growth_bound=0.15,
)
FULL = Durations(
    baseline_s=10.0,
    outage_s=15.0,
    recover_s=15.0,
    soak_s=600.0,
    soak_warmup_s=60.0,
    capacity_probe_s=15.0,
    corrupt_chunks=10_000,
    event_frames=100_000,
    http_cases=10_000,
    overload_burst_s=15.0,
)


@dataclass(frozen=True, slots=True)
class FaultSpan:
    """One fault, from injection to the moment it was lifted."""

    name: str
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class FaultLog:
    """The run's clock and the faults injected so far (spans never overlap).

    Args:
        t0: ``time.perf_counter()`` at the run's start.
    """

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = time.perf_counter() if t0 is None else t0
        self.spans: list[FaultSpan] = []
        self._open: tuple[str, float] | None = None

    def now(self) -> float:
        """Seconds since the run's start."""
        return time.perf_counter() - self.t0

    def begin(self, name: str) -> float:
        """Mark a fault injected now; returns the time.

        Raises:
            ValueError: another fault is still open.
        """
        if self._open is not None:
            raise ValueError(f"fault {name!r} begun while {self._open[0]!r} is still open")
        start = self.now()
        self._open = (name, start)
        return start

    def end(self) -> FaultSpan:
        """Mark the open fault lifted now.

        Raises:
            ValueError: no fault is open.
        """
        if self._open is None:
            raise ValueError("no fault is open")
        name, start = self._open
        self._open = None
        span = FaultSpan(name, start, max(start, self.now()))
        self.spans.append(span)
        return span

    @contextmanager
    def fault(self, name: str) -> Iterator[None]:
        """``with log.fault("redis SIGSTOP"):`` — the span covers the block, even when it raises."""
        self.begin(name)
        try:
            yield
        finally:
            self.end()
