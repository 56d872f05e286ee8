"""Loopback port helpers."""

import random
import socket

import pytest

from kvmesh.core import net
from kvmesh.core.net import FIRST_PORT, LOOPBACK, MIN_RANGE, ephemeral_range, free_port, free_ports


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(20)
    assert len(set(ports)) == 20 and all(p > 0 for p in ports)
    for port in (*ports[:3], free_port()):
        with socket.socket() as sock:
            sock.bind((LOOPBACK, port))


def test_ports_come_from_below_the_ephemeral_range():
    low, _ = ephemeral_range()
    if low - FIRST_PORT < MIN_RANGE:
        pytest.skip(f"this kernel's ephemeral range starts at {low}")
    ports = free_ports(50)
    assert all(FIRST_PORT <= p < low for p in ports)


def _take_1st_and_3rd(low: int) -> tuple[int, list[socket.socket]] | None:
    """A window of 4 ports below ``low``: the 1st and 3rd bound by the returned sockets, the 2nd
    and 4th free when checked (no outgoing connection gets a port there, so they stay free)."""
    for _ in range(50):
        first = random.randrange(FIRST_PORT, low - 4)
        held: list[socket.socket] = []
        try:
            for port in (first, first + 2):
                sock = socket.socket()
                held.append(sock)
                sock.bind((LOOPBACK, port))
            for port in (first + 1, first + 3):
                with socket.socket() as probe:
                    probe.bind((LOOPBACK, port))
        except OSError:
            for sock in held:
                sock.close()
            continue
        return first, held
    return None


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    # a range of 4 ports, the 1st and 3rd taken: each draw is the 2nd or the 4th
    low, _ = ephemeral_range()
    window = _take_1st_and_3rd(low) if low - FIRST_PORT > 4 else None
    if window is None:
        pytest.skip("no window of 4 ports below the ephemeral range to use")
    first, held = window
    try:
        monkeypatch.setattr(net, "FIRST_PORT", first)
        monkeypatch.setattr(net, "MIN_RANGE", 0)
        monkeypatch.setattr(net, "ephemeral_range", lambda: (first + 4, 65535))
        for _ in range(20):
            (port,) = free_ports(1)
            assert port in {first + 1, first + 3}
    finally:
        for sock in held:
            sock.close()
