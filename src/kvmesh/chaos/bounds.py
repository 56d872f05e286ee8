"""What a scenario measured and the bounds it asserts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

Comparison = Literal["<=", "<", ">=", "=="]


@dataclass(frozen=True, slots=True)
class Bound:
    """One asserted figure: ``value <op> limit``.

    A ``nan`` value (the figure could not be measured) fails every comparison.
    """

    name: str
    value: float
    op: Comparison
    limit: float
    unit: str = ""

    def __post_init__(self) -> None:
        if self.op not in ("<=", "<", ">=", "=="):
            raise ValueError(f"bound {self.name}: unknown comparison {self.op!r}")

    @property
    def passed(self) -> bool:
        if math.isnan(self.value):
            return False
        match self.op:
            case "<=":
                return self.value <= self.limit
            case "<":
                return self.value < self.limit
            case ">=":
                return self.value >= self.limit
            case "==":
                return self.value == self.limit
        raise AssertionError(f"bound {self.name}: comparison {self.op!r} not handled")

    def describe(self) -> str:
        """``"0 failed requests <= 0"``-style text for tables and logs."""
        unit = f" {self.unit}" if self.unit else ""
        return f"{_fmt(self.value)}{unit} {self.op} {_fmt(self.limit)}{unit}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": None if math.isnan(self.value) else self.value,
            "op": self.op,
            "limit": self.limit,
            "unit": self.unit,
            "passed": self.passed,
        }


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    if float(x).is_integer():
        return str(int(x))
    return f"{x:.3g}"


@dataclass(slots=True)
class ScenarioResult:
    """One scenario: its bounds, its other figures, and the error that stopped it (if any).

    A scenario passes when it ran to the end and every bound holds; one with no bound at all
    did not measure anything and fails.
    """

    name: str
    title: str
    bounds: list[Bound] = field(default_factory=list)
    figures: dict[str, float | int | str] = field(default_factory=dict)
    error: str | None = None
    duration_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.bounds) and all(b.passed for b in self.bounds)

    def check(self, name: str, value: float, op: Comparison, limit: float, unit: str = "") -> Bound:
        """Add a bound and return it."""
        bound = Bound(name, float(value), op, float(limit), unit)
        self.bounds.append(bound)
        return bound

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "passed": self.passed,
            "error": self.error,
            "duration_s": round(self.duration_s, 2),
            "bounds": [b.to_dict() for b in self.bounds],
            "figures": dict(self.figures),
        }
