"""Prometheus metrics of one store instance, on its own ``CollectorRegistry``.

Counters live in plain :class:`TierCounters` records (the store's own bookkeeping, also returned by
``stats()``); a custom collector turns them into metric families at scrape time, so the hot path
does one integer increment per event. Latencies are real histograms.

Metric names (label ``tier`` = cpu, disk, redis, fs)::

    kvmesh_store_chunk_hits_total{tier}          chunks served by the tier
    kvmesh_store_chunk_misses_total{tier}        chunks asked of the tier that it did not hold
    kvmesh_store_bytes_total{tier,direction}     encoded bytes read / written
    kvmesh_store_errors_total{tier,reason}       timeout | unavailable | breaker_open
    kvmesh_store_corrupt_chunks_total{tier}      failed checksum/HMAC/header → deleted, not served
    kvmesh_store_dropped_writes_total{tier}      chunks dropped because a write queue was full
                                                 or the tier failed the write
    kvmesh_store_promotions_total{tier}          chunks copied into the tier from a slower one
    kvmesh_store_evictions_total{tier}           chunks evicted by the byte budget
    kvmesh_store_breaker_state{tier}             0 closed, 1 half-open, 2 open
    kvmesh_store_write_queue_bytes{tier}         encoded bytes waiting in the write queue
    kvmesh_store_tier_bytes{tier}                bytes held (-1 unknown)
    kvmesh_store_op_seconds{tier,op}             latency of exists / get / put / delete calls
    kvmesh_store_lookup_chunks_total{result}     chunks asked (query) and found (hit) by lookups
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(slots=True)
class TierCounters:
    """Monotonic counters of one tier."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    timeouts: int = 0
    unavailable: int = 0
    breaker_rejections: int = 0
    corrupt: int = 0
    dropped_writes: int = 0
    promotions: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class TierSnapshot:
    """What the collector reads about one tier at scrape time."""

    name: str
    counters: TierCounters
    breaker_state: int
    queue_bytes: int
    num_evictions: int
    num_bytes: int


def _per_tier(
    family: type[CounterMetricFamily | GaugeMetricFamily],
    readings: list[tuple[str, str, Callable[[TierSnapshot], int]]],
    snaps: list[TierSnapshot],
) -> Iterator[Metric]:
    """One family per ``(name, doc, read)`` reading, with one sample per tier."""
    for name, doc, read in readings:
        fam = family(name, doc, labels=["tier"])
        for s in snaps:
            fam.add_metric([s.name], read(s))
        yield fam


class _StoreCollector(Collector):
    def __init__(self, source: Callable[[], list[TierSnapshot]], lookups: Callable[[], tuple[int, int]]):
        self._source = source
        self._lookups = lookups

    def collect(self) -> Iterator[Metric]:
        snaps = self._source()
        families: list[tuple[str, str, Callable[[TierSnapshot], int]]] = [
            ("kvmesh_store_chunk_hits", "Chunks served by the tier", lambda s: s.counters.hits),
            (
                "kvmesh_store_chunk_misses",
                "Chunks asked of the tier that it did not hold",
                lambda s: s.counters.misses,
            ),
            (
                "kvmesh_store_corrupt_chunks",
                "Chunks that failed verification (deleted, never served)",
                lambda s: s.counters.corrupt,
            ),
            (
                "kvmesh_store_dropped_writes",
                "Chunks whose write was dropped",
                lambda s: s.counters.dropped_writes,
            ),
            ("kvmesh_store_promotions", "Chunks promoted into the tier", lambda s: s.counters.promotions),
            ("kvmesh_store_evictions", "Chunks evicted by the byte budget", lambda s: s.num_evictions),
        ]
        yield from _per_tier(CounterMetricFamily, families, snaps)
        nbytes = CounterMetricFamily(
            "kvmesh_store_bytes", "Encoded bytes moved", labels=["tier", "direction"]
        )
        errors = CounterMetricFamily(
            "kvmesh_store_errors", "Failed or refused tier calls", labels=["tier", "reason"]
        )
        for s in snaps:
            nbytes.add_metric([s.name, "read"], s.counters.bytes_read)
            nbytes.add_metric([s.name, "write"], s.counters.bytes_written)
            errors.add_metric([s.name, "timeout"], s.counters.timeouts)
            errors.add_metric([s.name, "unavailable"], s.counters.unavailable)
            errors.add_metric([s.name, "breaker_open"], s.counters.breaker_rejections)
        yield nbytes
        yield errors
        gauges: list[tuple[str, str, Callable[[TierSnapshot], int]]] = [
            ("kvmesh_store_breaker_state", "0 closed, 1 half-open, 2 open", lambda s: s.breaker_state),
            (
                "kvmesh_store_write_queue_bytes",
                "Encoded bytes waiting to be written",
                lambda s: s.queue_bytes,
            ),
            ("kvmesh_store_tier_bytes", "Bytes held by the tier (-1 unknown)", lambda s: s.num_bytes),
        ]
        yield from _per_tier(GaugeMetricFamily, gauges, snaps)
        queried, hit = self._lookups()
        lookups = CounterMetricFamily(
            "kvmesh_store_lookup_chunks", "Chunks asked and found by lookups", labels=["result"]
        )
        lookups.add_metric(["query"], queried)
        lookups.add_metric(["hit"], hit)
        yield lookups


class StoreMetrics:
    """The metrics of one store; never touches prometheus_client's global registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.op_seconds = Histogram(
            "kvmesh_store_op_seconds",
            "Latency of tier calls",
            labelnames=["tier", "op"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._collector: _StoreCollector | None = None

    def attach(
        self, source: Callable[[], list[TierSnapshot]], lookups: Callable[[], tuple[int, int]]
    ) -> None:
        """Register the collector that reads the store's counters (once)."""
        assert self._collector is None, "StoreMetrics.attach called twice; one store per metrics object"
        self._collector = _StoreCollector(source, lookups)
        self.registry.register(self._collector)

    def observe(self, tier: str, op: str, seconds: float) -> None:
        self.op_seconds.labels(tier=tier, op=op).observe(seconds)

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
