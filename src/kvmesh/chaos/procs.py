"""Resident memory and open files of a fleet's processes, read from ``/proc`` (Linux).

:func:`fd_kinds` says what a process's descriptors are: each TCP socket is matched by inode
against ``/proc/PID/net/tcp{,6}`` and named by direction and port, so a count that grows can be
traced to the connections (and the peer) that make it grow.
"""

from __future__ import annotations

import collections
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
    fd_kinds: collections.Counter[str] | None = None
    """What the descriptors are (:func:`fd_kinds`)."""

    @property
    def num_connections(self) -> int | None:
        """TCP connections, accepted or made."""
        if self.fd_kinds is None:
            return None
        return sum(n for kind, n in self.fd_kinds.items() if kind.startswith(("tcp in", "tcp out")))

    @property
    def num_other_fds(self) -> int | None:
        """Descriptors that are not TCP connections: files, pipes, event fds, listening and other sockets."""
        if self.open_fds is None or self.num_connections is None:
            return None
        return self.open_fds - self.num_connections

    def connections_to(self, port: int) -> int | None:
        """TCP connections this process made to ``port``."""
        return None if self.fd_kinds is None else self.fd_kinds[f"tcp out :{port}"]


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


_TCP_LISTEN = "0A"
"""``st`` column of ``/proc/net/tcp`` for a listening socket."""


def _tcp_sockets(pid: int) -> dict[str, tuple[int, str, int, str]]:
    """Socket inode → (local port, remote address, remote port, state) of the process's net namespace."""
    out: dict[str, tuple[int, str, int, str]] = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
                    raddr, rport = remote.split(":")
                    out[inode] = (int(local.split(":")[1], 16), raddr, int(rport, 16), state)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out


def fd_kinds(pid: int) -> collections.Counter[str] | None:
    """What ``pid``'s open descriptors are, counted by kind; ``None`` when it cannot be read.

    Kinds: ``tcp listen :PORT``; ``tcp in :PORT`` (accepted on one of its listening ports);
    ``tcp out :PORT`` (connected to that remote port; ``tcp out`` alone for a socket not yet
    connected); ``socket`` (other sockets: Unix, UDP, ZMQ's internals); ``pipe``;
    ``anon [eventfd]``-style for anonymous inodes; ``file`` for everything else.
    """
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    targets: list[str] = []
    for name in names:
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            continue  # closed between listdir and readlink
    tcp = _tcp_sockets(pid)
    listening = {port for port, _, _, state in tcp.values() if state == _TCP_LISTEN}
    kinds: collections.Counter[str] = collections.Counter()
    for target in targets:
        if target.startswith("socket:["):
            entry = tcp.get(target[8:-1])
            if entry is None:
                kinds["socket"] += 1
                continue
            lport, _, rport, state = entry
            if state == _TCP_LISTEN:
                kinds[f"tcp listen :{lport}"] += 1
            elif lport in listening:
                kinds[f"tcp in :{lport}"] += 1
            else:
                kinds[f"tcp out :{rport}" if rport else "tcp out"] += 1
        elif target.startswith("pipe:["):
            kinds["pipe"] += 1
        elif target.startswith("anon_inode:"):
            kinds[f"anon {target[11:]}"] += 1
        else:
            kinds["file"] += 1
    return kinds


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
    out: dict[str, ProcSample] = {}
    for name, pid in pids.items():
        kinds = fd_kinds(pid)
        out[name] = ProcSample(
            name, pid, read_rss_bytes(pid), None if kinds is None else kinds.total(), kinds
        )
    return out


def growth(first: int | None, last: int | None) -> float:
    """Relative growth ``last / first - 1``; ``nan`` when either is unknown."""
    if first is None or last is None or first <= 0:
        return float("nan")
    return last / first - 1.0
