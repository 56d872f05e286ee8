"""Pinned blocks: the router's record of prompts clients pinned, kept in the index until expiry.

A request that asks for a pin (:mod:`kvmesh.core.pins`) and is answered 200 had its prompt's chunks
pinned in the fleet's shared tier by the engine that served it. The router records the prompt's
block keys with the pin's deadline; the in-memory index consults :meth:`PinnedBlocks.holds` before
its capacity LRU drops a key, and passes pinned keys over until their deadline. The record is made
from the request (the router knows the TTL it forwarded); the engines' ``SHARED`` events still say
which blocks the shared tier holds, so a pin on a prompt the engine could not store keeps nothing
the index does not have. Keys past their deadline are dropped lazily (when the LRU reaches them)
and in sweeps when the record has doubled since the last one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvmesh.core.types import BlockKey

_MIN_SWEEP_SIZE = 1024


class PinnedBlocks:
    """Block keys with a deadline, on one event loop (no locks).

    Args:
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._until: dict[BlockKey, float] = {}
        self._sweep_at = _MIN_SWEEP_SIZE

    def pin(self, keys: Iterable[BlockKey], ttl_s: float) -> None:
        """Hold ``keys`` for ``ttl_s`` seconds from now; a key held longer keeps its deadline."""
        now = self.clock()
        until = now + ttl_s
        held = self._until
        for key in keys:
            if held.get(key, 0.0) < until:
                held[key] = until
        if len(held) >= self._sweep_at:
            self._sweep(now)

    def holds(self, key: BlockKey) -> bool:
        """Whether ``key`` is pinned now (an expired entry is dropped)."""
        until = self._until.get(key)
        if until is None:
            return False
        if until > self.clock():
            return True
        del self._until[key]
        return False

    def _sweep(self, now: float) -> None:
        self._until = {k: t for k, t in self._until.items() if t > now}
        self._sweep_at = max(_MIN_SWEEP_SIZE, 2 * len(self._until))

    def __len__(self) -> int:
        return len(self._until)
