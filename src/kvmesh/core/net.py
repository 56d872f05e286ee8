"""Loopback ports for the processes and test servers kvmesh starts on one machine."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
FIRST_PORT = 10_000
"""Lowest port handed out: below it sit well-known services' registered ports."""
MIN_RANGE = 2_000
"""Fewest ports below the ephemeral range for choosing there; with fewer, the OS picks."""
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_rng = random.Random()  # seeded from the OS: processes started together do not draw alike


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel assigns to outgoing connections (Linux's default when unreadable)."""
    try:
        low, high = (int(v) for v in _EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports free right now (all held open until all are chosen).

    They are drawn below the kernel's ephemeral range: a port the OS hands out for ``bind(0)`` is
    also one it may give an outgoing connection as its source port, so a server started a minute
    later (vLLM's start-up) found it taken.

    Args:
        count: how many ports.
        host: the address they must be free on.

    Returns:
        The ports; another process may still take one before the caller binds it.
    """
    low, _ = ephemeral_range()
    if low - FIRST_PORT < max(MIN_RANGE, 4 * count):
        return _os_ports(count, host)
    socks: list[socket.socket] = []
    tried: set[int] = set()
    try:
        for _ in range(64 * count):
            if len(socks) == count:
                break
            port = _rng.randrange(FIRST_PORT, low)
            if port in tried:
                continue
            tried.add(port)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            socks.append(sock)
        if len(socks) < count:
            return _os_ports(count, host)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def _os_ports(count: int, host: str) -> list[int]:
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port(host: str = LOOPBACK) -> int:
    """One port free right now (see :func:`free_ports`)."""
    (port,) = free_ports(1, host)
    return port
