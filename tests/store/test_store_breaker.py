"""CircuitBreaker state machine, on a fake clock."""

from __future__ import annotations

import pytest

from kvmesh.store.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_only() -> None:
    breaker = CircuitBreaker(failure_threshold=3, clock=Clock())
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert breaker.num_opens == 1


def test_half_open_allows_one_probe_and_backoff_doubles_to_cap() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=1, backoff_s=1.0, max_backoff_s=3.0, clock=clock)
    breaker.record_failure()
    assert not breaker.allow()
    assert breaker.retry_in_s == 1.0
    clock.now = 1.0
    assert breaker.allow()
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow(), "only one probe at a time"
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert breaker.retry_in_s == 2.0
    clock.now = 3.0
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.retry_in_s == 3.0, "capped"
    clock.now = 6.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure()
    assert breaker.retry_in_s == 1.0, "backoff resets after a success"
    assert breaker.num_rejected == 2


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError, match="backoff"):
        CircuitBreaker(backoff_s=2.0, max_backoff_s=1.0)
