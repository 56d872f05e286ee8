"""Arrival times: open-loop stages (Poisson or constant) or a closed-loop batch due at time 0."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

from kvmesh.errors import ConfigError
from kvmesh.workload.spec import Arrival, Stage


def stage_arrivals(
    stages: Sequence[Stage], arrival: Arrival, rng: random.Random
) -> Iterator[tuple[float, int]]:
    """Yield ``(arrival_s, stage_index)`` for back-to-back stages.

    Poisson stages draw exponential gaps at the stage's rate; constant stages space requests ``1/rate``
    apart. A stage's arrivals all fall inside its own ``[start, start + duration)`` window.
    """
    if arrival not in ("poisson", "constant"):
        raise ConfigError(f"arrival must be 'poisson' or 'constant', got {arrival!r}")
    start = 0.0
    for index, stage in enumerate(stages):
        end = start + stage.duration
        t = start
        k = 0
        while True:
            k += 1
            # constant arrivals are computed, not summed, so rounding never adds one at the stage end
            t = t + rng.expovariate(stage.rate) if arrival == "poisson" else start + k / stage.rate
            if t >= end:
                break
            yield t, index
        start = end


def request_arrivals(
    stages: Sequence[Stage] | None, num_requests: int | None, arrival: Arrival, rng: random.Random
) -> Iterator[tuple[float, int]]:
    """``(arrival_s, stage_index)`` of each request: ``stages`` when given, else ``num_requests``
    requests all due at time 0 (for a closed-loop runner to pace)."""
    if stages:
        yield from stage_arrivals(stages, arrival, rng)
        return
    if num_requests is None:
        raise ConfigError("a workload needs load stages or num_requests")
    for _ in range(num_requests):
        yield 0.0, 0


def expected_num_requests(stages: Sequence[Stage]) -> int:
    """Mean number of requests of open-loop stages (rate × duration summed)."""
    return math.floor(sum(s.rate * s.duration for s in stages))
