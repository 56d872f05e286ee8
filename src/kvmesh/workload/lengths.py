"""Token lengths: fixed, or normal and clipped (inference-perf's forms)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from kvmesh.errors import ConfigError


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token length: fixed, or normal with ``mean``/``std_dev`` clipped to ``[min, max]``.

    Accepts inference-perf's forms: a plain int, or ``{mean, std_dev, min, max}``.
    """

    mean: float
    std_dev: float = 0.0
    min: int = 1
    max: int = 1 << 30

    @classmethod
    def parse(cls, value: int | float | Mapping[str, Any] | LengthDist, what: str = "length") -> LengthDist:
        """Build a distribution from an int or a mapping.

        Raises:
            ConfigError: a negative or inconsistent specification.
        """
        if isinstance(value, LengthDist):
            return value
        if isinstance(value, bool):
            raise ConfigError(f"{what}: expected an int or {{mean, std_dev, min, max}}, got {value!r}")
        if isinstance(value, int | float):
            if value < 0:
                raise ConfigError(f"{what} must be >= 0, got {value}")
            return cls(mean=float(value), std_dev=0.0, min=int(value), max=int(value))
        if isinstance(value, Mapping):
            unknown = set(value) - {"mean", "std_dev", "min", "max"}
            if unknown or "mean" not in value:
                raise ConfigError(f"{what}: expected keys mean, std_dev, min, max; got {sorted(value)}")
            mean = float(value["mean"])
            std = float(value.get("std_dev", 0.0))
            lo = int(value.get("min", 0 if std else mean))
            hi = int(value.get("max", 1 << 30 if std else mean))
            if std < 0 or lo < 0 or hi < lo:
                raise ConfigError(f"{what}: need std_dev >= 0 and 0 <= min <= max, got {dict(value)}")
            return cls(mean=mean, std_dev=std, min=lo, max=hi)
        raise ConfigError(f"{what}: expected an int or {{mean, std_dev, min, max}}, got {value!r}")

    def sample(self, rng: random.Random) -> int:
        """Draw one length (a fixed length draws nothing from ``rng``)."""
        if self.std_dev == 0.0:
            return max(self.min, min(self.max, round(self.mean)))
        return max(self.min, min(self.max, round(rng.gauss(self.mean, self.std_dev))))


LengthLike: TypeAlias = int | float | Mapping[str, Any] | LengthDist
