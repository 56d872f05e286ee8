"""BackgroundSaver: saves run off the caller's thread, and a request is released once, after its
last save ran (or failed)."""

from __future__ import annotations

import threading

from kvmesh.core.hashing import Namespace
from kvmesh.integrations.background_saver import BackgroundSaver
from kvmesh.integrations.request_tracker import SaveSpec


def spec(req_id: str) -> SaveSpec:
    return SaveSpec(req_id, (1, 2), (0,), 0, 2, Namespace("m"))


def test_a_request_is_released_once_after_its_last_save() -> None:
    gate = threading.Event()
    ran: list[tuple[str, object]] = []

    def run(s: SaveSpec, after: object) -> None:
        assert gate.wait(10.0)
        ran.append((s.req_id, after))

    saver = BackgroundSaver(run)
    try:
        saver.submit(spec("r"), "fence-1")
        saver.submit(spec("r"))  # returns although the first save is blocked
        assert saver.finished({"r", "unknown"}) == set()  # still saving; unknown ids are ignored
        gate.set()
        assert saver.wait_for({"r"}, 10.0)
        assert ran == [("r", "fence-1"), ("r", None)]  # in order, each with what it was submitted with
        assert saver.finished(set()) == {"r"}  # remembered as finished by vLLM
        assert saver.finished({"r"}) == set()  # reported once
    finally:
        gate.set()
        saver.close(10.0)


def test_a_failed_save_counts_as_done() -> None:
    def run(s: SaveSpec, after: object) -> None:
        raise RuntimeError("boom")

    saver = BackgroundSaver(run)
    try:
        saver.submit(spec("bad"))
        assert saver.wait_for({"bad"}, 10.0)
        assert saver.num_failed == 1
        assert saver.finished({"bad"}) == {"bad"}
    finally:
        saver.close(10.0)
