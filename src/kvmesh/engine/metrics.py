"""Prometheus metrics of one engine, under vLLM's names so routers and dashboards read them unchanged.

Gauges and counters are read from the engine core when scraped (nothing on the hot path); latency
histograms are observed by the server as requests finish. Each engine owns its own
``CollectorRegistry``, so many engines can live in one process.

    vllm:num_requests_running / vllm:num_requests_waiting      gauges
    vllm:kv_cache_usage_perc                                   gauge, 0..1 (as vLLM reports it)
    vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total   prompt tokens looked up / found
    vllm:prompt_tokens_total / vllm:generation_tokens_total
    vllm:num_preemptions_total
    vllm:time_to_first_token_seconds / vllm:e2e_request_latency_seconds   histograms
    kvmesh:cached_tokens_total{tier}                          prompt tokens served from each cache tier
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvmesh.engine.core import EngineCore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)  # fmt: skip


class _CoreCollector(Collector):
    def __init__(self, core: EngineCore, model_name: str) -> None:
        self._core = core
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        core, labels, values = self._core, ["model_name"], [self._model]
        stats = core.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in model execution batches.", core.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", core.num_waiting)
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", core.cache.usage
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in prompt tokens.",
            stats.num_prefix_query_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens.", stats.num_prefix_hit_tokens
        )
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", stats.num_prompt_tokens)
        yield counter("vllm:generation_tokens", "Generation tokens processed.", stats.num_generation_tokens)
        yield counter("vllm:num_preemptions", "Cumulative preemptions.", stats.num_preemptions)
        tiers = CounterMetricFamily(
            "kvmesh:cached_tokens", "Prompt tokens served from a cache tier.", labels=["model_name", "tier"]
        )
        seen: set[str] = set()
        for tier in ("GPU", "CPU", "DISK", "SHARED", *sorted(stats.cached_tokens_by_tier)):
            if tier in seen:
                continue
            seen.add(tier)
            tiers.add_metric([self._model, tier], stats.cached_tokens_by_tier.get(tier, 0))
        yield tiers
        yield gauge("kvmesh:cached_blocks", "Blocks in the device-tier cache.", core.cache.num_cached_blocks)
        yield counter("kvmesh:evicted_blocks", "Blocks evicted from the device tier.", core.cache.num_evicted)
        yield counter("kvmesh:store_writes", "Prompt KV writes handed to the store.", stats.num_store_writes)
        yield counter(
            "kvmesh:store_write_failures", "Store writes that failed.", stats.num_store_write_failures
        )
        yield counter(
            "kvmesh:store_read_failures",
            "Store loads that failed and were recomputed.",
            stats.num_store_read_failures,
        )
        yield counter("kvmesh:store_loads", "Prefixes loaded from the store.", stats.num_store_loads)
        yield counter(
            "kvmesh:store_fetch_seconds",
            "Seconds spent looking up and reading the prefixes loaded from the store.",
            stats.store_fetch_seconds,
        )
        yield counter(
            "kvmesh:store_to_device_seconds",
            "Seconds the engine loop spent handing loaded prefixes to the runner (device copies) at admission.",
            stats.store_to_runner_seconds,
        )
        yield counter(
            "kvmesh:kv_export_failures",
            "Computed KV the runner could not hand over (not cached).",
            stats.num_kv_export_failures,
        )


class EngineMetrics:
    """The metrics of one engine.

    Args:
        core: the engine core whose state gauges and counters read.
        model_name: value of the ``model_name`` label.
    """

    def __init__(self, core: EngineCore, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        self.registry.register(_CoreCollector(core, model_name))
        self.ttft = self._latency(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self.e2e = self._latency(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            _E2E_BUCKETS,
        )
        self.itl = self._latency(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS
        )
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._http = Counter(
            "kvmesh:http_requests",
            "HTTP requests by route and status.",
            ["route", "status"],
            registry=self.registry,
        )

    def _latency(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        """A seconds histogram of this engine's model, as vLLM names and labels it."""
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(
            self.model_name
        )

    def observe_request(
        self, ttft: float | None, e2e: float, finish_reason: str | None, token_gaps: Sequence[float] = ()
    ) -> None:
        """Record a finished request (``token_gaps``: seconds between its consecutive tokens)."""
        if ttft is not None:
            self.ttft.observe(ttft)
        for gap in token_gaps:
            self.itl.observe(gap)
        self.e2e.observe(e2e)
        if finish_reason in ("stop", "length"):
            self._success.labels(self.model_name, finish_reason).inc()

    def observe_http(self, route: str, status: int) -> None:
        self._http.labels(route, str(status)).inc()

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)
