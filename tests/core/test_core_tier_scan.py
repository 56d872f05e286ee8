"""PrefixScan: each chunk's fastest holder and the stored prefix, as the store and the simulator use it."""

from __future__ import annotations

from kvmesh.core.tier_scan import PrefixScan


def test_each_tier_is_asked_only_about_chunks_no_faster_tier_holds() -> None:
    scan = PrefixScan(5)
    ram = {0, 2}
    remote = {0, 1, 2, 4}
    asked = []
    for t, tier in enumerate((ram, remote)):
        todo = scan.unresolved()
        asked.append(todo)
        scan.record(t, todo, [i in tier for i in todo])
    assert asked == [[0, 1, 2, 3, 4], [1, 3, 4]]
    assert scan.holder == [0, 1, 0, None, 1]
    assert scan.num_held == 3, "chunk 3 is held nowhere: the prefix ends before it"
    assert scan.served_by(0) == [0, 2] and scan.served_by(1) == [1]
    assert scan.served_by(1, first=2) == [], "chunk 4 lies past the gap"


def test_an_empty_or_unanswered_scan_holds_nothing() -> None:
    assert PrefixScan(0).num_held == 0
    scan = PrefixScan(3)
    scan.record(0, [], [])
    assert scan.num_held == 0 and scan.unresolved() == [0, 1, 2]
