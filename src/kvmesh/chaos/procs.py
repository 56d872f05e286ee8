"""Resident memory and open files of a fleet's processes, read from ``/proc`` (Linux)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvmesh.fleet.launcher import Fleet


@dataclass(frozen=True, slots=True)
class ProcSample:
    """One process at one moment; ``None`` fields when it could not be read (exited)."""

    name: str
    pid: int
    rss_bytes: int | None
    open_fds: int | None


def read_rss_bytes(pid: int) -> int | None:
    """``VmRSS`` of ``pid`` in bytes, or ``None`` when the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def count_open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def fleet_pids(fleet: Fleet) -> dict[str, int]:
    """Name → pid of every running process of ``fleet`` (router, engines, shared server)."""
    out: dict[str, int] = {}
    if fleet.router is not None and fleet.router.pid is not None:
        out["router"] = fleet.router.pid
    for e in fleet.engines:
        if e.process.pid is not None:
            out[e.process.name] = e.process.pid
    store = fleet.store_process
    if store is not None and store.pid is not None:
        out[store.name] = store.pid
    return out


def sample(pids: dict[str, int]) -> dict[str, ProcSample]:
    return {
        name: ProcSample(name, pid, read_rss_bytes(pid), count_open_fds(pid)) for name, pid in pids.items()
    }


def growth(first: int | None, last: int | None) -> float:
    """Relative growth ``last / first - 1``; ``nan`` when either is unknown."""
    if first is None or last is None or first <= 0:
        return float("nan")
    return last / first - 1.0
