"""Prompt-cache usage per tenant, for chargeback: prompt, cached and prewarmed tokens.

Counted from what the engines report (``usage`` or the kvmesh engine's ``x-kvmesh-cached``
header), never from the router's prediction. The first ``max_tenants`` tenants seen get their own
row; later ones are added up under :data:`OTHER_TENANTS`, which bounds the Prometheus label
cardinality (and the memory) whatever the clients send. The tenant ``""`` is requests without one.

Exported by :class:`UsageCollector` at scrape time::

    kvmesh_router_tenant_requests_total{tenant}
    kvmesh_router_tenant_prompt_tokens_total{tenant}
    kvmesh_router_tenant_cached_tokens_total{tenant,tier}   tier "unknown" when the engine did not say
    kvmesh_router_tenant_prewarmed_tokens_total{tenant}
    kvmesh_router_tenant_unreported_requests_total{tenant}  answers without a cached-token figure
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

OTHER_TENANTS = "(other)"
"""The row of every tenant beyond ``max_tenants``."""
UNKNOWN_TIER = "unknown"
"""Tier of cached tokens whose engine reported no tiers (vLLM)."""


@dataclass(slots=True)
class TenantUsage:
    """One tenant's totals.

    Attributes:
        requests: answered requests counted.
        prompt_tokens: their prompt tokens.
        cached_tokens: prompt tokens the engines served from a cache.
        cached_by_tier: ``cached_tokens`` per tier (:data:`UNKNOWN_TIER` when not reported).
        prewarmed_tokens: prompt tokens computed ahead of time for the tenant (prewarm).
        unreported_requests: answers with no cached-token figure (a stream without
            ``include_usage`` from an engine that sends no ``x-kvmesh-cached``): their prompt
            tokens are counted, their cached tokens are not known.
    """

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    prewarmed_tokens: int = 0
    unreported_requests: int = 0


class UsageLedger:
    """Per-tenant prompt-cache counters with a bounded number of rows.

    Args:
        max_tenants: tenants counted on their own row; the rest share :data:`OTHER_TENANTS`.
    """

    def __init__(self, max_tenants: int = 256) -> None:
        if max_tenants < 0:
            raise ValueError(f"max_tenants must be >= 0, got {max_tenants}")
        self.max_tenants = max_tenants
        self._rows: dict[str, TenantUsage] = {}
        self._num_own = 0

    def _row(self, tenant: str) -> TenantUsage:
        row = self._rows.get(tenant)
        if row is not None:
            return row
        if self._num_own < self.max_tenants and tenant != OTHER_TENANTS:
            self._num_own += 1
            row = self._rows[tenant] = TenantUsage()
            return row
        row = self._rows.get(OTHER_TENANTS)
        if row is None:
            row = self._rows[OTHER_TENANTS] = TenantUsage()
        return row

    def add_request(
        self,
        tenant: str,
        *,
        prompt_tokens: int,
        cached_tokens: int | None,
        cached_by_tier: Mapping[str, int] | None = None,
    ) -> None:
        """Count one answered request.

        Args:
            tenant: the request's tenant (``""``: none).
            prompt_tokens: its prompt tokens.
            cached_tokens: prompt tokens served from a cache; ``None`` when the engine did not say.
            cached_by_tier: ``cached_tokens`` per tier, when the engine said.
        """
        row = self._row(tenant)
        row.requests += 1
        row.prompt_tokens += max(0, prompt_tokens)
        if cached_tokens is None:
            row.unreported_requests += 1
            return
        row.cached_tokens += cached_tokens
        by_tier = row.cached_by_tier
        accounted = 0
        for tier, n in (cached_by_tier or {}).items():
            by_tier[tier] = by_tier.get(tier, 0) + n
            accounted += n
        if cached_tokens > accounted:
            by_tier[UNKNOWN_TIER] = by_tier.get(UNKNOWN_TIER, 0) + cached_tokens - accounted

    def add_prewarmed(self, tenant: str, tokens: int) -> None:
        """Count ``tokens`` prompt tokens computed ahead of requests for ``tenant``.

        Raises:
            ValueError: ``tokens`` is negative.
        """
        if tokens < 0:
            raise ValueError(f"prewarmed tokens must be >= 0, got {tokens}")
        self._row(tenant).prewarmed_tokens += tokens

    def get(self, tenant: str) -> TenantUsage:
        """A copy of ``tenant``'s row (zeros when it has none)."""
        row = self._rows.get(tenant)
        if row is None:
            return TenantUsage()
        return TenantUsage(**{**asdict(row), "cached_by_tier": dict(row.cached_by_tier)})

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every row as JSON-ready dicts, by tenant."""
        return {tenant: asdict(row) for tenant, row in sorted(self._rows.items())}


class UsageCollector:
    """Exports a :class:`UsageLedger` at scrape time.

    Args:
        ledger: the ledger.
    """

    def __init__(self, ledger: UsageLedger) -> None:
        self._ledger = ledger

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        def family(name: str, doc: str, *labels: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"kvmesh_router_tenant_{name}", doc, labels=["tenant", *labels])

        requests = family("requests", "Answered requests per tenant")
        prompt = family("prompt_tokens", "Prompt tokens per tenant")
        cached = family("cached_tokens", "Prompt tokens served from a cache per tenant and tier", "tier")
        prewarmed = family("prewarmed_tokens", "Prompt tokens prewarmed per tenant")
        unreported = family("unreported_requests", "Answers without a cached-token figure per tenant")
        for tenant, row in self._ledger._rows.items():
            requests.add_metric([tenant], row.requests)
            prompt.add_metric([tenant], row.prompt_tokens)
            for tier, n in sorted(row.cached_by_tier.items()):
                cached.add_metric([tenant, tier], n)
            prewarmed.add_metric([tenant], row.prewarmed_tokens)
            unreported.add_metric([tenant], row.unreported_requests)
        yield from (requests, prompt, cached, prewarmed, unreported)
