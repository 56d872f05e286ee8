"""Pins: chunks a tenant asked to keep in a shared tier until a deadline, within a byte budget.

A pin holds chunk keys a tenant's namespace produced (the tenant is in every key's chain root, so a
tenant can only ever name its own chunks). While pinned, a chunk is exempt from the tier's
eviction; when the pin expires it becomes ordinary data again. Re-pinning a chunk moves its
deadline later, never earlier. Each tier keeps, per tenant, a ledger of its pins (deadline and
size) in the tier itself, so every engine sharing the tier shares the budget:

    redis / valkey   backends/redis_pins.py   sorted set of deadlines + hash of sizes, one Lua call
    shared dir       backends/fs_pins.py      one marker file per pin (mtime = deadline), flock

A pin that would take the tenant's pinned bytes in a tier past its budget is refused whole; a pin
never evicts another pin.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvmesh.store.keys import StoreKey

GB = 1 << 30


def tenant_id(tenant: str) -> str:
    """The tenant's name in ledgers: 16 hex chars of sha256 (any text, no separator clashes)."""
    return hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class PinOutcome:
    """What one tier did with one pin request (or would do, for a check)."""

    tier: str
    accepted: bool
    """Whether the pin was taken (for a check: whether it fits the budget)."""
    num_pinned: int
    """Chunks pinned or extended (for a check: chunks that would be)."""
    num_missing: int
    """Chunks the tier does not hold (not pinned; a check counts them at the estimated size)."""
    used_bytes: int
    """The tenant's pinned bytes in this tier after the call (for a refusal or a check: before)."""
    added_bytes: int
    """Bytes this pin adds (or would add) to the tenant's total; re-pinned chunks add nothing."""
    budget_bytes: int
    expires_at: float
    """Unix time the pin ends (0 when refused)."""
    reason: str = ""
    """Why the tier cannot pin at all (its configuration); empty for a budget refusal."""

    @property
    def over_budget(self) -> bool:
        """Refused because the tenant's budget is too small (not because the tier cannot pin)."""
        return not self.accepted and not self.reason

    def refusal(self, tenant: str) -> str:
        """The sentence a refused request gets: which budget, how full, how much more was asked."""
        if self.reason:
            return self.reason
        who = f"tenant {tenant!r}" if tenant else "the default tenant"
        return (
            f"pin budget exceeded: {who} may pin {self.budget_bytes} bytes in store tier "
            f"'{self.tier}' and holds {self.used_bytes}; this prompt needs {self.added_bytes} more"
        )


@dataclass(frozen=True, slots=True)
class PinRequest:
    """One tenant's pin of some chunks in one tier."""

    keys: Sequence[StoreKey]
    """Chunk keys of the tenant's namespace."""
    tenant: str
    """Whose budget pays."""
    ttl_s: float
    """The pin's lifetime, in seconds from now."""
    budget_bytes: int
    """The tenant's budget in this tier."""
    estimate_bytes: int | None = None
    """A check only (nothing changes), counting a key the tier lacks at this many bytes: it is about
    to be written."""


@runtime_checkable
class PinLedger(Protocol):
    """A tier's pins: taken, extended and released against per-tenant budgets."""

    async def pin_many(self, request: PinRequest) -> PinOutcome:
        """Pin the held ``request.keys`` for ``request.ttl_s`` seconds if the tenant's total stays
        within its budget (see :class:`PinRequest`).

        Raises:
            TierUnavailableError: the tier cannot be reached.
        """
        ...

    async def release_expired(self) -> int:
        """Turn pins past their deadline back into ordinary chunks; returns how many."""
        ...


def pin_ledger(backend: object) -> PinLedger | None:
    """The backend's pin ledger, or ``None`` when its tier cannot pin."""
    ledger = getattr(backend, "pins", None)
    return ledger if isinstance(ledger, PinLedger) else None


@dataclass(frozen=True, slots=True)
class PinBudgets:
    """Bytes each tenant may pin per tier.

    Args:
        default_gb: per tier name ("redis", "fs"), the budget of every tenant, in GB (2^30 bytes).
        tenants_gb: per tenant, per tier, a budget that replaces the default.
    """

    default_gb: Mapping[str, float]
    tenants_gb: Mapping[str, Mapping[str, float]]

    def bytes_for(self, tenant: str, tier: str) -> int:
        """The tenant's budget in ``tier`` (0: no pins there)."""
        own = self.tenants_gb.get(tenant)
        if own is not None and tier in own:
            return int(own[tier] * GB)
        return int(self.default_gb.get(tier, 0.0) * GB)

    def tiers(self, tenant: str) -> list[str]:
        """Tiers where ``tenant`` may pin anything."""
        names = set(self.default_gb) | set(self.tenants_gb.get(tenant, {}))
        return sorted(name for name in names if self.bytes_for(tenant, name) > 0)
