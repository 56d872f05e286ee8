"""When each endpoint's running requests will give their KV back, from how long answers last.

A prompt that does not fit an engine's free KV waits until enough running requests finish. A mean
release rate (:mod:`kvmesh.router.kv_release`) is right on average and wrong exactly where the wait
is long: on coding-agent traffic a few answers run for minutes (output lengths are heavy-tailed) and
each holds a 100k-token context the whole time, so an engine full of such answers frees nothing for
a long while, and one that has just started three short answers frees their KV in a second.

The router sees each answer's first token and its end. :class:`DecodeDurations` keeps the last
answers' durations (first token to end) of the whole pool; an answer that has run for ``age``
seconds is expected to run ``E[D - age | D > age]`` more (for heavy tails that grows with age; past
every sample it is taken to be ``age`` again). :class:`KVReleaseForecast` keeps, per endpoint, the
answers running there and their prompts' KV, and publishes
``EndpointState.kv_releases``, read only when a price asks.

Running prompts that share blocks hold less KV than their sum: a hundred chats on one system prompt
hold it once. The engine's KV fill over the sum of the running prompts (the held ratio, at most 1)
says how much: near 1 where sessions hold their own histories (an idle session's cached turn must be
taken back from the free KV), far below where hot prefixes are shared (a new chat on the system
prompt needs only its own tokens). Released tokens are scaled by it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from itertools import accumulate

from kvmesh.router.types import EndpointState

DEFAULT_SAMPLES = 512
MIN_SAMPLES = 16
"""Answers seen to end before the forecast is published (until then: no forecast)."""


class DecodeDurations:
    """The durations of the last ``capacity`` answers, and the expected rest of a running one.

    Raises:
        ValueError: ``capacity`` below ``MIN_SAMPLES``.
    """

    def __init__(self, capacity: int = DEFAULT_SAMPLES) -> None:
        if capacity < MIN_SAMPLES:
            raise ValueError(f"capacity must be at least {MIN_SAMPLES}, got {capacity}")
        self._samples: deque[float] = deque(maxlen=capacity)
        self._sorted: list[float] = []
        self._suffix: list[float] = []
        """``_suffix[i]``: the sum of ``_sorted[i:]``."""
        self._stale = False

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, seconds: float) -> None:
        self._samples.append(max(seconds, 0.0))
        self._stale = True

    def remaining(self, age: float) -> float:
        """Expected seconds left of an answer that has run ``age`` seconds."""
        if self._stale:
            self._sorted = sorted(self._samples)
            self._suffix = list(accumulate(reversed(self._sorted)))[::-1]
            self._stale = False
        ordered = self._sorted
        i = bisect_right(ordered, age)
        if i == len(ordered):
            return age
        return self._suffix[i] / (len(ordered) - i) - age


@dataclass(slots=True)
class _Running:
    tokens: int
    since: float


class EndpointReleases:
    """One endpoint's running answers, read when a price asks (``EndpointState.kv_releases``).

    Nothing is computed at refresh: a decision that finds the free KV sufficient never reads it.
    """

    __slots__ = ("_durations", "held", "now", "running", "state")

    def __init__(self, state: EndpointState, durations: DecodeDurations) -> None:
        self.state = state
        self._durations = durations
        self.running: dict[str, _Running] = {}
        self.held = 0
        """The running prompts' tokens, summed (kept as they start and end: read per decision)."""
        self.now = 0.0

    def start(self, request_id: str, tokens: int, now: float) -> None:
        old = self.running.get(request_id)
        if old is not None:
            self.held -= old.tokens
        self.running[request_id] = _Running(tokens, now)
        self.held += tokens

    def end(self, request_id: str) -> _Running | None:
        entry = self.running.pop(request_id, None)
        if entry is not None:
            self.held -= entry.tokens
        return entry

    def held_ratio(self) -> float:
        """The engine's KV fill over the sum of the running prompts, at most 1 (1 when either is
        unknown): below 1 where running prompts share blocks."""
        held = self.held
        state = self.state
        used = state.kv_cache_usage * state.kv_capacity_tokens
        return min(used / held, 1.0) if held > 0 and used > 0 else 1.0

    def schedule(self) -> list[tuple[float, int]]:
        """(seconds until released, KV tokens) of the running answers in release order, the tokens
        scaled by :meth:`held_ratio`; empty until ``MIN_SAMPLES`` answers were seen to end."""
        if len(self._durations) < MIN_SAMPLES or not self.running:
            return []
        ratio = self.held_ratio()
        remaining, now = self._durations.remaining, self.now
        return sorted((remaining(now - r.since), round(r.tokens * ratio)) for r in self.running.values())

    def wait(self, short: float, rate: float) -> float | None:
        """Seconds until ``short`` tokens are free: when enough running answers have ended, the
        rest (beyond what they hold) at ``rate`` tokens/s; ``None``: no forecast (too few answers
        seen, none running, or not enough held and no rate)."""
        schedule = self.schedule()
        if not schedule:
            return None
        freed = 0
        for seconds, tokens in schedule:
            freed += tokens
            if freed >= short:
                return seconds
        if rate > 0.0:
            return schedule[-1][0] + (short - freed) / rate
        return None


class KVReleaseForecast:
    """Per endpoint, the KV its running answers release and when (see the module docstring).

    Call :meth:`started` at an answer's first token, :meth:`ended` at its end and :meth:`refresh`
    before each decision.
    """

    def __init__(self, durations: DecodeDurations | None = None) -> None:
        self.durations = durations or DecodeDurations()
        self._endpoints: dict[str, EndpointReleases] = {}

    def started(self, state: EndpointState, request_id: str, kv_tokens: int, now: float) -> None:
        """``request_id``'s first token arrived from ``state``'s endpoint, where its prompt holds
        ``kv_tokens`` of KV until it ends."""
        endpoint = self._endpoints.get(state.pod)
        if endpoint is None or endpoint.state is not state:
            endpoint = self._endpoints[state.pod] = EndpointReleases(state, self.durations)
            endpoint.now = now
            state.kv_releases = endpoint
        endpoint.start(request_id, max(kv_tokens, 0), now)

    def ended(self, state: EndpointState, request_id: str, now: float) -> None:
        """``request_id``'s answer at ``state``'s endpoint is over (one that never started is
        ignored)."""
        endpoint = self._endpoints.get(state.pod)
        entry = None if endpoint is None else endpoint.end(request_id)
        if entry is not None:
            self.durations.add(now - entry.since)

    def refresh(self, now: float) -> None:
        """Set the time every endpoint's forecast is read at."""
        for endpoint in self._endpoints.values():
            endpoint.now = now
