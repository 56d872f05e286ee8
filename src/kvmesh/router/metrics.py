"""The router's Prometheus metrics, on a registry of its own (one per gateway instance).

==============================================  =============================================
``kvmesh_router_decisions_total{endpoint}``     requests routed to each endpoint
``kvmesh_router_prefill_decisions_total{...}``  P/D prefill legs per prefill endpoint
``kvmesh_router_prompt_tokens_total``           prompt tokens of routed requests
``kvmesh_router_predicted_hit_tokens_total``    cached prompt tokens the index predicted
``kvmesh_router_realized_hit_tokens_total``     ``usage.prompt_tokens_details.cached_tokens``
``kvmesh_router_scorer_seconds{scorer}``        time per scorer per decision
``kvmesh_router_schedule_seconds``              tokenize + match + pick, per request
``kvmesh_router_retries_total``                 connect failures retried on the next endpoint
``kvmesh_router_errors_total{kind}``            requests answered with an error, by cause
==============================================  =============================================
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


class RouterMetrics:
    """Counters and histograms of one gateway.

    Args:
        registry: where to register; a fresh one by default.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "kvmesh_router_decisions", "Requests routed per endpoint", ["endpoint"], registry=r
        )
        self.prefill_decisions = Counter(
            "kvmesh_router_prefill_decisions", "P/D prefill legs per endpoint", ["endpoint"], registry=r
        )
        self.prompt_tokens = Counter("kvmesh_router_prompt_tokens", "Prompt tokens routed", registry=r)
        self.predicted_hit_tokens = Counter(
            "kvmesh_router_predicted_hit_tokens", "Prompt tokens the index predicted cached", registry=r
        )
        self.realized_hit_tokens = Counter(
            "kvmesh_router_realized_hit_tokens", "Prompt tokens the engines reported cached", registry=r
        )
        self.scorer_seconds = Histogram(
            "kvmesh_router_scorer_seconds", "Scorer latency", ["scorer"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.schedule_seconds = Histogram(
            "kvmesh_router_schedule_seconds",
            "Tokenize, prefix match and pick per request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter("kvmesh_router_retries", "Connect failures retried elsewhere", registry=r)
        self.errors = Counter("kvmesh_router_errors", "Requests answered with an error", ["kind"], registry=r)

        self._scorer_children: dict[str, Any] = {}
        self._decision_children: dict[str, Any] = {}

    def observe_scorer(self, scorer: str, seconds: float) -> None:
        """Record one scorer run (the scheduler's ``on_timing`` hook)."""
        child = self._scorer_children.get(scorer)
        if child is None:
            child = self._scorer_children[scorer] = self.scorer_seconds.labels(scorer)
        child.observe(seconds)

    def count_decision(self, pod: str) -> None:
        """Count one request sent to ``pod`` (label children are cached: ``labels()`` is slow)."""
        child = self._decision_children.get(pod)
        if child is None:
            child = self._decision_children[pod] = self.decisions.labels(pod)
        child.inc()
