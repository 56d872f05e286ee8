"""The router's probe intervals stretch while idle and snap back on the first request."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.router.idle_backoff import IdleBackoff


async def test_idle_rounds_double_the_wait_up_to_the_cap_and_a_busy_round_resets_it():
    backoff = IdleBackoff(0.001, max_s=0.004)
    seen = []
    for _ in range(4):
        await backoff.wait(busy=False)
        seen.append(backoff.interval_s)
    assert seen == [0.002, 0.004, 0.004, 0.004]
    await backoff.wait(busy=True)
    assert backoff.interval_s == 0.001


async def test_a_request_ends_a_stretched_wait_and_restores_the_base_interval():
    backoff = IdleBackoff(1.0, max_s=600.0)
    backoff.interval_s = 300.0
    waiter = asyncio.create_task(backoff.wait(busy=False))
    await asyncio.sleep(0)
    assert not waiter.done() and backoff.interval_s == 600.0
    backoff.note_activity()
    await asyncio.wait_for(waiter, 5.0)
    assert backoff.interval_s == 1.0


def test_a_zero_interval_never_stretches_and_a_negative_one_is_refused():
    assert IdleBackoff(0.0).interval_s == 0.0
    with pytest.raises(ValueError, match="negative"):
        IdleBackoff(-1.0)


def test_the_idle_cap_scales_with_a_short_interval():
    assert IdleBackoff(0.5).max_s == 8.0
    assert IdleBackoff(0.05).max_s == pytest.approx(0.8)
    assert IdleBackoff(30.0).max_s == 30.0
