"""Links with bandwidth, latency and FIFO queueing, in virtual time.

A transfer occupies its link for ``bytes / bandwidth`` seconds after the link frees up, then takes
``latency`` more to land. Two transfers on one link therefore queue, which is how a shared tier's
network turns into a bottleneck in the simulator: the bandwidth math (replicas × req/s × remote-miss
fraction × KV bytes per prefix) is not a formula here, it is what the links end up carrying.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def gbps_to_bytes_per_s(gbps: float) -> float:
    """Network gigabits per second → bytes per second (1 Gb/s = 125 MB/s)."""
    return gbps * 1e9 / 8


@dataclass(slots=True)
class Link:
    """One direction of one pipe.

    Args:
        bytes_per_s: bandwidth; ``math.inf`` for a link that never limits.
        latency_s: added once per transfer (round trip of the request, first byte).
    """

    bytes_per_s: float
    latency_s: float = 0.0
    busy_until: float = 0.0
    num_bytes: int = 0
    """Bytes carried so far."""
    num_transfers: int = 0
    busy_s: float = 0.0
    """Seconds spent transmitting (excludes latency and idle time)."""

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"bandwidth must be positive, got {self.bytes_per_s} bytes/s")
        if self.latency_s < 0:
            raise ValueError(f"latency must be non-negative, got {self.latency_s} s")

    def transfer(self, now: float, num_bytes: int, not_before: float = 0.0) -> float:
        """Queue ``num_bytes`` on this link at ``now``; return when the last byte arrives.

        ``not_before`` delays the start (e.g. until the other end of a two-link path is free).
        """
        if num_bytes <= 0:
            return now
        start = max(now, self.busy_until, not_before)
        duration = 0.0 if math.isinf(self.bytes_per_s) else num_bytes / self.bytes_per_s
        self.busy_until = start + duration
        self.busy_s += duration
        self.num_bytes += num_bytes
        self.num_transfers += 1
        return start + duration + self.latency_s


def path_transfer(now: float, num_bytes: int, *links: Link) -> float:
    """Send ``num_bytes`` across several links in series (the store's NIC, then a replica's NIC).

    Each link is its own FIFO server: it is busy for ``num_bytes`` at its own rate, from when it frees
    up. The transfer lands when the last link is through, plus the largest latency on the path. So a
    fast store NIC serves several slower replica NICs at once, and a store NIC slower than the sum of
    its clients becomes the queue.
    """
    if num_bytes <= 0 or not links:
        return now
    done = now
    for link in links:
        done = max(done, link.transfer(now, num_bytes) - link.latency_s)
    return done + max(link.latency_s for link in links)
