"""The fault log and the run modes' phase lengths."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.chaos.schedule import FULL, QUICK, FaultLog


def test_spans_record_begin_and_end_in_order():
    log = FaultLog(t0=0.0)
    log.begin("redis SIGKILL")
    first = log.end()
    with log.fault("router restart"):
        pass
    assert [s.name for s in log.spans] == ["redis SIGKILL", "router restart"]
    assert first.end_s >= first.start_s and log.spans[1].start_s >= first.end_s


def test_overlapping_or_unopened_faults_are_refused():
    log = FaultLog()
    log.begin("a")
    with pytest.raises(ValueError, match="'a' is still open"):
        log.begin("b")
    log.end()
    with pytest.raises(ValueError, match="no fault is open"):
        log.end()


def test_a_fault_block_that_raises_still_closes_its_span():
    log = FaultLog()
    with pytest.raises(RuntimeError), log.fault("engine-1 SIGKILL"):
        raise RuntimeError("restart failed")
    assert [s.name for s in log.spans] == ["engine-1 SIGKILL"]
    log.begin("next")  # nothing left open


def test_modes_and_their_validation():
    assert QUICK.soak_s < FULL.soak_s and QUICK.corrupt_chunks == 1_000 and FULL.corrupt_chunks == 10_000
    assert QUICK.event_frames == 5_000 and FULL.event_frames == 100_000
    with pytest.raises(ValueError, match="warm-up"):
        dataclasses.replace(QUICK, soak_warmup_s=QUICK.soak_s)
