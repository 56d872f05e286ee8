"""BackgroundLoader: loads run off the caller's thread, in order, each reported once with the blocks
it could not fill; a load that raises fails all its blocks."""

from __future__ import annotations

import threading

from kvmesh.core.hashing import Namespace
from kvmesh.integrations.background_loader import BackgroundLoader
from kvmesh.integrations.request_tracker import LoadSpec


def spec(req_id: str) -> LoadSpec:
    return LoadSpec(req_id, (1, 2, 3), (4, 5, 6), 16, 48, Namespace("m"), True)


def test_loads_are_reported_once_with_their_failed_blocks() -> None:
    gate = threading.Event()
    ran: list[str] = []

    def run(s: LoadSpec) -> set[int]:
        assert gate.wait(10.0)
        ran.append(s.req_id)
        return {6} if s.req_id == "short" else set()

    def blocks_of(s: LoadSpec) -> set[int]:
        return set(s.block_ids)

    def boom(s: LoadSpec) -> set[int]:
        raise RuntimeError("store gone")

    loader = BackgroundLoader(run, blocks_of)
    try:
        loader.submit(spec("whole"))
        loader.submit(spec("short"))  # returns although the first load is blocked
        assert loader.take_finished() == {} and loader.num_in_flight() == 2
        gate.set()
        for _ in range(1000):
            if loader.num_in_flight() == 0:
                break
            threading.Event().wait(0.01)
        assert ran == ["whole", "short"]
        assert loader.take_finished() == {"whole": set(), "short": {6}}
        assert loader.take_finished() == {}  # reported once
    finally:
        gate.set()
        loader.close(10.0)

    failing = BackgroundLoader(boom, blocks_of)
    try:
        failing.submit(spec("x"))
        for _ in range(1000):
            if failing.num_in_flight() == 0:
                break
            threading.Event().wait(0.01)
        assert failing.take_finished() == {"x": {4, 5, 6}} and failing.num_failed == 1
    finally:
        failing.close(10.0)
