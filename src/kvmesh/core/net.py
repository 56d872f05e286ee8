"""Loopback ports for the processes and test servers kvmesh starts on one machine."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports the OS reports free right now (all held open until all are chosen).

    Args:
        count: how many ports.
        host: the address they must be free on.

    Returns:
        The ports; another process may still take one before the caller binds it.
    """
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
    """One port the OS reports free right now (see :func:`free_ports`)."""
    (port,) = free_ports(1, host)
    return port
