"""Pins as the engine sees them: checked before a request runs, taken after its prompt is written.

A request asking for a pin (:mod:`kvmesh.core.pins`) is checked against the tenant's budgets
before it is queued, counting the prompt's chunks the shared tiers lack at the store's chunk size:
a pin that cannot fit is refused with a 429 naming the budget, before any work. After the prompt's
KV is written (to every tier, even where the device tier held it), the store pins it; the tiers'
ledgers decide again, atomically, since engines sharing a tier share its budget. A pin that another
engine's pin beat to the budget in between is not taken (the request was already served; a
prefill-role request, which returns only once its prompt is stored, answers 429 then).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmesh.core.pins import PIN_BUDGET_STATUS, check_pin_ttl, requested_pin_ttl
from kvmesh.errors import RequestError

if TYPE_CHECKING:
    from kvmesh.engine.store_connector import PrefixStore


@dataclass(frozen=True, slots=True)
class PinResult:
    """One store tier's answer to a pin (or to a check)."""

    tier: str
    accepted: bool
    expires_at: float
    """Unix time the pin ends (0: refused, or a check)."""
    message: str
    """For a refusal, the sentence naming the budget or why the tier cannot pin."""
    over_budget: bool
    """Refused by a budget (rather than by the tier's configuration)."""

    def to_dict(self) -> dict[str, object]:
        return {"tier": self.tier, "accepted": self.accepted, "expires_at": self.expires_at}


def refusal_error(results: list[PinResult]) -> RequestError | None:
    """The error a request gets for the first refused tier (``None``: every tier took the pin).

    A budget refusal is a 429 (a quota); a tier that cannot pin at all (its configuration) a 503.
    """
    for result in results:
        if not result.accepted:
            status = PIN_BUDGET_STATUS if result.over_budget else 503
            return RequestError(result.message, status=status, param="kvmesh")
    return None


def no_budget_error(tenant: str) -> RequestError:
    """The error of a pin requested where the tenant has no pin budget in any tier."""
    who = f"tenant {tenant!r}" if tenant else "the default tenant"
    return RequestError(
        f"pin budget exceeded: {who} has no pin budget in this engine's store "
        "(max_pinned_remote_size, max_pinned_shared_dir_size, max_pinned_local_cpu_size or pin_tenant_budgets)",
        status=PIN_BUDGET_STATUS,
        param="kvmesh",
    )


async def admit_pin(
    store: PrefixStore,
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    prompts: list[list[int]],
    tenant: str,
) -> float | None:
    """The pin lifetime a request asks for, once its prompts fit the tenant's pin budgets.

    Args:
        store: the engine's store.
        headers: the request headers.
        body: the body's ``kvmesh`` and ``kv_transfer_params`` fields.
        prompts: the request's prompts as token ids.
        tenant: the request's tenant.

    Returns:
        Seconds to pin for; ``None`` when the request asks for no pin.

    Raises:
        RequestError: a malformed or too long lifetime (400), no budget or a budget too small (429),
            or a tier that cannot pin (503).
    """
    ttl_s = requested_pin_ttl(headers, body)
    if ttl_s is None:
        return None
    max_ttl_s = store.pin_max_ttl_s(tenant)
    if max_ttl_s is None:
        raise no_budget_error(tenant)
    check_pin_ttl(ttl_s, max_ttl_s)
    for prompt in prompts:
        error = refusal_error(await store.pin(prompt, tenant, ttl_s, check=True))
        if error is not None:
            raise error
    return ttl_s
