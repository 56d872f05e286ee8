"""Loopback port helpers."""

import socket

from kvmesh.core.net import LOOPBACK, free_port, free_ports


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(20)
    assert len(set(ports)) == 20 and all(p > 0 for p in ports)
    for port in (*ports[:3], free_port()):
        with socket.socket() as sock:
            sock.bind((LOOPBACK, port))
