"""Pins in the RAM tier: one process's ledger, honoured by its LRU while the pins fit.

Best effort, unlike the shared tiers: the RAM tier belongs to one engine, so its pins are that
engine's (a restart forgets them), and each tenant's budget (``max_pinned_local_cpu_size``) is per
engine. :class:`~kvmesh.store.backends.memory.MemoryBackend` passes pinned chunks over when it
evicts; when only pinned chunks are left, the new chunk is not stored rather than a pin evicted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from kvmesh.store.keys import StoreKey
from kvmesh.store.pins import PinLedger, PinOutcome, PinRequest


@dataclass(slots=True)
class _Pin:
    deadline: float
    tenant: str
    size: int


class MemoryPinLedger:
    """Pins of one in-process tier.

    Args:
        size_of: the size of a held chunk, ``None`` when the tier lacks it.
        clock: seconds since the epoch (injectable for tests).
    """

    def __init__(
        self, size_of: Callable[[StoreKey], int | None], clock: Callable[[], float] = time.time
    ) -> None:
        self._size_of = size_of
        self._clock = clock
        self._pins: dict[StoreKey, _Pin] = {}
        self._used: dict[str, int] = {}

    def holds(self, key: StoreKey) -> bool:
        """Whether ``key`` is pinned now (an expired pin is released)."""
        pin = self._pins.get(key)
        if pin is None:
            return False
        if pin.deadline > self._clock():
            return True
        self._release(key, pin)
        return False

    def forget(self, keys: Collection[StoreKey]) -> None:
        """The tier dropped ``keys`` (deleted, flushed): their pins go too."""
        for key in keys:
            pin = self._pins.get(key)
            if pin is not None:
                self._release(key, pin)

    def _release(self, key: StoreKey, pin: _Pin) -> None:
        del self._pins[key]
        self._used[pin.tenant] -= pin.size

    async def pin_many(self, request: PinRequest) -> PinOutcome:
        await self.release_expired()
        tenant, budget_bytes, estimate_bytes = request.tenant, request.budget_bytes, request.estimate_bytes
        now = self._clock()
        deadline = now + request.ttl_s
        used = self._used.get(tenant, 0)
        added = pinned = missing = 0
        held: list[tuple[StoreKey, int]] = []
        for key in dict.fromkeys(request.keys):
            size = self._size_of(key)
            if size is None:
                missing += 1
                if estimate_bytes is not None:
                    added += estimate_bytes
                    pinned += 1
                continue
            pinned += 1
            held.append((key, size))
            if key not in self._pins:
                added += size
        if used + added > budget_bytes:
            return PinOutcome("cpu", False, pinned, missing, used, added, budget_bytes, 0.0)
        if estimate_bytes is not None:
            return PinOutcome("cpu", True, pinned, missing, used, added, budget_bytes, 0.0)
        for key, size in held:
            pin = self._pins.get(key)
            if pin is None:
                self._pins[key] = _Pin(deadline, tenant, size)
            elif pin.deadline < deadline:
                pin.deadline = deadline
        self._used[tenant] = used + added
        return PinOutcome("cpu", True, pinned, missing, used + added, added, budget_bytes, deadline)

    async def release_expired(self) -> int:
        now = self._clock()
        due = [(key, pin) for key, pin in self._pins.items() if pin.deadline <= now]
        for key, pin in due:
            self._release(key, pin)
        return len(due)

    def __len__(self) -> int:
        return len(self._pins)


_check: type[PinLedger] = MemoryPinLedger
