"""The rolling-restart scenario's count of routing decisions without cache data."""

from __future__ import annotations

from kvmesh.bench.metrics import RequestResult
from kvmesh.chaos.rolling_restart import (
    decisions_without_cache_data,
    miss_reason,
    reasons_without_cache,
    served_without_cache,
)


def _result(cached: int, note: str | None, *, group: str | None = "g", ok: bool = True) -> RequestResult:
    return RequestResult("r", 0, 0.0, ok, 513, cached_tokens=cached, group=group, cache_note=note)


def test_miss_reason_reads_the_header_and_says_when_there_was_none() -> None:
    assert miss_reason("cached=0;prompt=513;reason=store_fault;tier=SHARED") == "store_fault"
    assert miss_reason("cached=0;prompt=513; reason = cold") == "cold"
    assert miss_reason(None) == "unreported"
    assert miss_reason("cached=0;prompt=513") == "unreported"


def test_only_the_routers_own_misses_count_as_decisions_without_cache_data() -> None:
    results = [
        _result(0, "cached=0;prompt=513;reason=store_fault"),
        _result(0, "cached=0;prompt=513;reason=evicted;lost=512"),
        _result(0, "cached=0;prompt=513;reason=cold"),
        _result(0, None),
        _result(512, "cached=512;prompt=513;reason=partial_block"),
        _result(0, "cached=0;prompt=513;reason=cold", group=None),  # a fresh prompt
        _result(0, "cached=0;prompt=513;reason=cold", ok=False),
    ]
    assert len(served_without_cache(results)) == 4
    assert decisions_without_cache_data(results) == 3
    assert reasons_without_cache(results) == "store_fault:1,evicted:1,cold:1,unreported:1"
