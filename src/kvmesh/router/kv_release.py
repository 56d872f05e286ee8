"""How fast each endpoint frees device KV, learned from the requests this router sees end.

A prompt that does not fit an engine's free KV waits until running requests finish and release
theirs (vLLM admits in arrival order). How long depends on the engine's decodes: on coding-agent
traffic with long outputs a full engine frees a few thousand tokens a second, on short chat answers
far more. A configured turnover time is right for one of those and wrong for the other, so the
router measures it: every request that ends at an endpoint released its prompt's KV there, and the
rate over the last ``horizon_s`` seconds is what a waiting prompt can expect. Output tokens are not
counted: a router does not see them in every answer, and on the long prompts where the wait matters
they are a small share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.router.types import EndpointState

DEFAULT_HORIZON_S = 30.0


@dataclass(slots=True)
class _Meter:
    state: EndpointState
    mass: float = 0.0
    """Tokens released, each weighted by ``exp(-age / horizon)``."""
    at: float = 0.0
    since: float = 0.0


class KVReleaseRates:
    """Per endpoint, the device KV tokens its requests released per second, recently.

    The rate is an exponentially weighted count of released tokens over ``horizon_s``; until an
    endpoint has been watched that long its count is divided by the time watched. It is written
    to ``EndpointState.kv_release_tokens_per_s`` (0 until a request ended there).

    Raises:
        ValueError: ``horizon_s`` not positive.
    """

    def __init__(self, horizon_s: float = DEFAULT_HORIZON_S) -> None:
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be positive, got {horizon_s}")
        self.horizon_s = horizon_s
        self._meters: dict[str, _Meter] = {}

    def watch(self, state: EndpointState, now: float) -> None:
        """Start timing ``state``'s endpoint (the first request sent there), so the first release
        is divided by the time it took, not by zero."""
        meter = self._meters.get(state.pod)
        if meter is None or meter.state is not state:
            self._meters[state.pod] = _Meter(state, at=now, since=now)

    def released(self, state: EndpointState, tokens: int, now: float) -> None:
        """A request that held ``tokens`` of KV ended at ``state``'s endpoint."""
        meter = self._meters.get(state.pod)
        if meter is None or meter.state is not state:
            meter = self._meters[state.pod] = _Meter(state, at=now, since=now)
        self._decay(meter, now)
        meter.mass += max(tokens, 0)
        self._publish(meter, now)

    def refresh(self, now: float) -> None:
        """Age every endpoint's count to ``now`` (an endpoint nothing ends at drifts to 0)."""
        # _decay and _publish inlined: this runs twice per routed request, for every endpoint.
        horizon = self.horizon_s
        least = min(1.0, horizon)
        exp, expm1 = math.exp, math.expm1
        for meter in self._meters.values():
            dt = now - meter.at
            if dt > 0:
                meter.mass *= exp(-dt / horizon)
                meter.at = now
            watched = now - meter.since
            if watched < least:
                watched = least
            meter.state.kv_release_tokens_per_s = meter.mass / (horizon * -expm1(-watched / horizon))

    def _decay(self, meter: _Meter, now: float) -> None:
        dt = now - meter.at
        if dt > 0:
            meter.mass *= math.exp(-dt / self.horizon_s)
            meter.at = now

    def _publish(self, meter: _Meter, now: float) -> None:
        # a rate over less than a second (or the horizon) is one request's size, not a rate
        watched = max(now - meter.since, min(1.0, self.horizon_s))
        # the weights of a steady stream sum to horizon × (1 - exp(-watched / horizon))
        span = self.horizon_s * -math.expm1(-watched / self.horizon_s)
        meter.state.kv_release_tokens_per_s = meter.mass / span
