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
``kvmesh_router_event_lag_seconds``             publish (the batch's ``ts``) to applied, per event
                                                batch; replayed history after a restart counts too
``kvmesh_router_ingest_*_total``                the event applier's counters (``IngestStats``
                                                without ``num_``): ``..._block_size_mismatch``,
                                                ``..._skipped_groups``, ``..._bad_events``, ...
``kvmesh_router_pod_block_size{endpoint}``      each pod's engine block size, from its events
``kvmesh_router_pod_indexed_blocks{endpoint}``  engine blocks tracked per pod
``kvmesh_router_pending_prefill_tokens{...}``   prompt tokens sent to an endpoint, no first token
                                                yet (less what it computed since, when learned)
``kvmesh_router_pending_prefill_requests{...}`` requests sent to an endpoint with no first token yet
``kvmesh_router_endpoint_kv_capacity_tokens``  each endpoint's device KV capacity (``/kvmesh/info`` or
                                                ``vllm:cache_config_info``; 0 unknown)
``kvmesh_router_session_kv_tokens{endpoint}``   latest prompts of the live sessions whose last turn
                                                went there (:mod:`kvmesh.router.session_contexts`)
``kvmesh_router_prefill_tokens_per_second``     the pool's prefill speed learned from first tokens
                                                (0 until learned)
``kvmesh_router_attention_context_tokens``      the context at which attention doubles a prompt
                                                token's cost, learned with it (0 until learned)
``kvmesh_router_flow_queue_depth{tenant,...}``  requests waiting in the flow-control queue, per
                                                tenant and ``priority``
``kvmesh_router_flow_queued_requests``          requests waiting in it, in all
``kvmesh_router_flow_queued_total``             requests that had to wait
``kvmesh_router_flow_queue_wait_seconds{...}``  time spent waiting, by ``outcome``: ``dispatched``,
                                                ``shed`` (429 at the deadline), ``cancelled``
``kvmesh_router_flow_shed_total{reason}``       requests answered 429: ``deadline``, ``queue_full``,
                                                ``tenant_queue_full``
``kvmesh_router_cache_requests_total{reason}``  requests by cache miss reason
                                                (:mod:`kvmesh.router.cache_report`)
``kvmesh_router_cache_missed_tokens_total``     prompt tokens not served from cache, by ``reason``
``kvmesh_router_tenant_*_total{tenant}``        per tenant: ``requests``, ``prompt_tokens``,
                                                ``cached_tokens`` (and ``tier``),
                                                ``prewarmed_tokens``, ``unreported_requests``
                                                (:mod:`kvmesh.router.usage`)
==============================================  =============================================

The ingest and endpoint figures are read when scraped (no per-event or per-request cost).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import fields
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvmesh.router.histograms import BucketHistogram, HistogramSeries
from kvmesh.router.ingest import EventApplier, IngestStats
from kvmesh.router.scrape_collector import ScrapeCollector
from kvmesh.router.types import EndpointState

_INGEST_HELP = {
    "num_events": "KV events applied",
    "num_blocks_stored": "Engine blocks added to the index",
    "num_blocks_removed": "Engine blocks removed from some tier",
    "num_clears": "AllBlocksCleared events and pod drops",
    "num_orphans": "BlockStored chains skipped because their parent hash was unknown",
    "num_unknown_hashes": "Removed or token-less stored hashes never seen stored",
    "num_bad_events": "Malformed BlockStored events skipped",
    "num_overflow": "Engine blocks pushed out because a pod's map was full",
    "num_block_size_mismatch": "BlockStored events skipped: block size not a multiple of the router's",
    "num_skipped_groups": "Events of KV cache groups not indexed (sliding window, Mamba, second group)",
}


class IngestCollector(ScrapeCollector[EventApplier | None]):
    """Exports an :class:`EventApplier`'s counters and per-pod block sizes at scrape time.

    Args:
        source: returns the applier (``None`` until the gateway has created it).
    """

    def collect(self) -> Iterator[Metric]:
        applier = self._source()
        if applier is None:
            return
        stats = applier.stats
        for f in fields(IngestStats):
            name = f.name.removeprefix("num_")
            yield CounterMetricFamily(
                f"kvmesh_router_ingest_{name}", _INGEST_HELP.get(f.name, f.name), value=getattr(stats, f.name)
            )
        sizes = GaugeMetricFamily(
            "kvmesh_router_pod_block_size", "Engine KV block size (tokens) per pod", labels=["endpoint"]
        )
        blocks = GaugeMetricFamily(
            "kvmesh_router_pod_indexed_blocks", "Engine blocks tracked per pod", labels=["endpoint"]
        )
        for pod, info in applier.pod_stats().items():
            if info["block_size"] is not None:
                sizes.add_metric([pod], info["block_size"])
            blocks.add_metric([pod], info["blocks"] or 0)
        yield sizes
        yield blocks


class EndpointLoadCollector(ScrapeCollector[Iterable[EndpointState]]):
    """Exports the endpoints' outstanding prefill work and the learned prefill speed and attention
    context at scrape time.

    Args:
        source: returns the endpoint states the scheduler sees.
    """

    def collect(self) -> Iterator[Metric]:
        pending = GaugeMetricFamily(
            "kvmesh_router_pending_prefill_tokens",
            "Prompt tokens routed to an endpoint that have no first token yet",
            labels=["endpoint"],
        )
        pending_requests = GaugeMetricFamily(
            "kvmesh_router_pending_prefill_requests",
            "Requests routed to an endpoint that have no first token yet",
            labels=["endpoint"],
        )
        capacity = GaugeMetricFamily(
            "kvmesh_router_endpoint_kv_capacity_tokens",
            "Device KV capacity of each endpoint in tokens (0 unknown)",
            labels=["endpoint"],
        )
        sessions = GaugeMetricFamily(
            "kvmesh_router_session_kv_tokens",
            "Latest prompts of the live sessions whose last turn was routed to an endpoint",
            labels=["endpoint"],
        )
        speed = context = 0.0
        for state in self._source():
            pending.add_metric([state.pod], state.pending_prefill_tokens)
            pending_requests.add_metric([state.pod], state.pending_prefills)
            capacity.add_metric([state.pod], state.kv_capacity_tokens)
            sessions.add_metric([state.pod], state.session_kv_tokens)
            if state.seconds_per_prefill_token > 0:
                speed = 1.0 / state.seconds_per_prefill_token
            context = state.attention_context_tokens or context
        yield pending
        yield pending_requests
        yield capacity
        yield sessions
        yield GaugeMetricFamily(
            "kvmesh_router_prefill_tokens_per_second",
            "Prefill speed learned from first-token times (0 until learned)",
            value=speed,
        )
        yield GaugeMetricFamily(
            "kvmesh_router_attention_context_tokens",
            "Context at which attention doubles a prompt token's cost, learned from first-token times "
            "(0 until learned)",
            value=context,
        )


class FlowQueueCollector(ScrapeCollector[Mapping[tuple[str, int], int]]):
    """Exports the flow-control queue's depth per tenant and priority at scrape time.

    Args:
        source: returns the queued requests per (tenant, priority).
    """

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "kvmesh_router_flow_queue_depth",
            "Requests waiting in the flow-control queue, per tenant and priority",
            labels=["tenant", "priority"],
        )
        total = 0
        for (tenant, priority), n in sorted(self._source().items()):
            depth.add_metric([tenant, str(priority)], n)
            total += n
        yield depth
        yield GaugeMetricFamily(
            "kvmesh_router_flow_queued_requests", "Requests waiting in the flow-control queue", value=total
        )


class UpstreamConnectionsCollector(ScrapeCollector[Mapping[str, tuple[int, int, int]]]):
    """Exports the request connections to each endpoint at scrape time.

    Args:
        source: returns (busy, idle, waiting requests) per endpoint.
    """

    def collect(self) -> Iterator[Metric]:
        connections = GaugeMetricFamily(
            "kvmesh_router_upstream_connections",
            "Connections open from the router to an endpoint for requests, busy (opening included) or idle",
            labels=["endpoint", "state"],
        )
        waiting = GaugeMetricFamily(
            "kvmesh_router_upstream_waiting_requests",
            "Requests waiting for a connection to an endpoint (upstream.maxConnectionsPerEndpoint reached)",
            labels=["endpoint"],
        )
        for endpoint, (busy, idle, queued) in sorted(self._source().items()):
            connections.add_metric([endpoint, "busy"], busy)
            connections.add_metric([endpoint, "idle"], idle)
            waiting.add_metric([endpoint], queued)
        yield connections
        yield waiting


_LATENCY_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
_EVENT_LAG_BUCKETS = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 60.0)
_QUEUE_WAIT_BUCKETS = (1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 60.0, 120.0)


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
        # Observed on every request (once per scorer): histograms without prometheus-client's locks.
        self.scorer_seconds = BucketHistogram(
            "kvmesh_router_scorer_seconds", "Scorer latency", _LATENCY_BUCKETS, label="scorer"
        )
        self.schedule_seconds = BucketHistogram(
            "kvmesh_router_schedule_seconds", "Tokenize, prefix match and pick per request", _LATENCY_BUCKETS
        )
        r.register(self.scorer_seconds)
        r.register(self.schedule_seconds)
        self.event_lag_seconds = Histogram(
            "kvmesh_router_event_lag_seconds",
            "Seconds from an engine publishing a KV event batch to the router applying it",
            buckets=_EVENT_LAG_BUCKETS,
            registry=r,
        )
        self.retries = Counter("kvmesh_router_retries", "Connect failures retried elsewhere", registry=r)
        self.errors = Counter("kvmesh_router_errors", "Requests answered with an error", ["kind"], registry=r)
        self.flow_queued = Counter(
            "kvmesh_router_flow_queued", "Requests that waited in the flow-control queue", registry=r
        )
        self.flow_shed = Counter(
            "kvmesh_router_flow_shed", "Requests answered 429 by flow control", ["reason"], registry=r
        )
        self.flow_wait_seconds = Histogram(
            "kvmesh_router_flow_queue_wait_seconds",
            "Seconds requests spent in the flow-control queue, by how they left it",
            ["outcome"],
            buckets=_QUEUE_WAIT_BUCKETS,
            registry=r,
        )

        self._scorer_children: dict[str, HistogramSeries] = {}
        self._decision_children: dict[str, Any] = {}

    def watch_ingest(self, source: Callable[[], EventApplier | None]) -> None:
        """Export the ingest counters and per-pod block sizes of the applier ``source`` returns."""
        self.registry.register(IngestCollector(source))

    def watch_endpoints(self, source: Callable[[], Iterable[EndpointState]]) -> None:
        """Export the outstanding prefill work of the endpoints ``source`` returns."""
        self.registry.register(EndpointLoadCollector(source))

    def watch_flow(self, source: Callable[[], Mapping[tuple[str, int], int]]) -> None:
        """Export the flow-control queue's depth per (tenant, priority) that ``source`` returns."""
        self.registry.register(FlowQueueCollector(source))

    def watch_upstream(self, source: Callable[[], Mapping[str, tuple[int, int, int]]]) -> None:
        """Export the request connections per endpoint, (busy, idle, waiting) as ``source`` returns them."""
        self.registry.register(UpstreamConnectionsCollector(source))

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
