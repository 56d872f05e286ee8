"""BucketHistogram exports what prometheus-client's Histogram exports for the same observations."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvmesh.router.histograms import BucketHistogram

_BUCKETS = (1e-5, 1e-4, 1e-3, 0.1, 1.0)
_OBSERVED = (0.0, 1e-5, 2e-5, 1e-4, 0.05, 0.1, 0.5, 2.0, 7.5)


def _samples(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return sorted(line for line in text.splitlines() if line and "_created" not in line)


def test_unlabelled_export_matches_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    hist = BucketHistogram("lat_seconds", "Latency", _BUCKETS)
    ours.register(hist)
    reference = Histogram("lat_seconds", "Latency", buckets=_BUCKETS, registry=theirs)
    for amount in _OBSERVED:
        hist.observe(amount)
        reference.observe(amount)
    assert _samples(ours) == _samples(theirs)


def test_labelled_export_matches_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    hist = BucketHistogram("scorer_seconds", "Scorer latency", _BUCKETS, label="scorer")
    ours.register(hist)
    reference = Histogram("scorer_seconds", "Scorer latency", ["scorer"], buckets=_BUCKETS, registry=theirs)
    for i, amount in enumerate(_OBSERVED):
        name = "prefix" if i % 3 else "load"
        hist.labels(name).observe(amount)
        reference.labels(name).observe(amount)
    assert hist.labels("load") is hist.labels("load")
    assert _samples(ours) == _samples(theirs)


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="ascending"):
        BucketHistogram("h", "h", (1.0, 0.5))
    with pytest.raises(ValueError, match="no label"):
        BucketHistogram("h", "h", _BUCKETS).labels("x")
    with pytest.raises(ValueError, match="labelled"):
        BucketHistogram("h", "h", _BUCKETS, label="x").observe(1.0)
