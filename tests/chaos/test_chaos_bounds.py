"""Bound checks and scenario verdicts."""

from __future__ import annotations

import math

import pytest

from kvmesh.chaos.bounds import Bound, ScenarioResult


@pytest.mark.parametrize(
    ("value", "op", "limit", "passed"),
    [
        (2.0, "<=", 2.0, True),
        (2.01, "<=", 2.0, False),
        (4.99, "<", 5.0, True),
        (5.0, "<", 5.0, False),
        (1.0, ">=", 1.0, True),
        (0.0, ">=", 1.0, False),
        (0.0, "==", 0.0, True),
        (3.0, "==", 0.0, False),
        (math.nan, "<=", 2.0, False),
        (math.nan, "==", 0.0, False),
    ],
)
def test_bound_comparisons(value, op, limit, passed):
    assert Bound("x", value, op, limit).passed is passed


def test_unknown_comparison_is_rejected():
    with pytest.raises(ValueError, match="unknown comparison"):
        Bound("x", 1.0, "!=", 0.0)  # type: ignore[arg-type]


def test_describe_and_dict_show_unmeasured_as_missing():
    b = Bound("rebuild", math.nan, "<=", 5.0, "s")
    assert b.describe() == "n/a s <= 5 s"
    assert b.to_dict() == {
        "name": "rebuild",
        "value": None,
        "op": "<=",
        "limit": 5.0,
        "unit": "s",
        "passed": False,
    }
    assert Bound("t", 0.477, "<=", 2.0, "s").describe() == "0.477 s <= 2 s"


def test_scenario_passes_only_with_all_bounds_held_and_no_error():
    res = ScenarioResult("s", "scenario")
    assert not res.passed, "a scenario that checked nothing must not pass"
    res.check("failed", 0, "==", 0)
    assert res.passed
    res.check("seconds", 2.5, "<=", 2.0, "s")
    assert not res.passed
    ok = ScenarioResult("s", "scenario", error="FleetError: boom")
    ok.check("failed", 0, "==", 0)
    assert not ok.passed
    assert ok.to_dict()["error"] == "FleetError: boom"
    assert [b["passed"] for b in res.to_dict()["bounds"]] == [True, False]
