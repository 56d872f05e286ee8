"""What each endpoint still has to prefill for this router, and how fast it prefills.

The router knows, for every request it sends, how many prompt tokens the chosen endpoint will have to
compute (prompt minus the prefix the index says it holds). Until the first token comes back those
tokens are the endpoint's outstanding prefill work: :class:`PrefillLedger` keeps their sum in
``EndpointState.pending_prefill_tokens``, current at every decision, where the engines' queue gauges
are one scrape old and count requests, not tokens.

When a first token arrives the request's time to first token is one sample of the pool's speed:
``ttft ≈ (tokens ahead of it + its own tokens) × seconds_per_token``. The estimate is the ratio of
exponentially weighted sums, seconds over tokens, of samples with at least ``min_tokens`` of work:
small prefills are dominated by fixed costs (a step's decode share, scheduling, the network) and a
least-squares slope through them swings with every burst. It is the per-request view of vLLM's
``vllm:time_to_first_token_seconds``, with the work ahead of each request known, which the engine's
histogram cannot say.

Work is counted in tokens at position 0: a token at position ``p`` attends to ``p`` earlier ones, so
with ``attention_context`` ``C`` it costs ``1 + p / C`` of them (``C`` is where attention doubles a
token's cost: twice the parameters over the attention FLOPs per token pair; about 30k for Qwen3-32B).
A 190k-token cold prompt is then about four times the work its token count says, and the endpoint
behind it is not reported idle while it is still prefilling. ``C = 0`` (the default) counts plain
tokens; the ``ttft-estimate-scorer``'s ``attentionContextTokens`` sets it for the router's ledger.

The fit is pooled over the endpoints (an inference pool serves one model on one kind of hardware):
per-endpoint fits on a few dozen samples differ by noise, and routing on that noise sends a request
away from the endpoint holding its prefix for no reason. Heterogeneous hardware belongs in separate
pools, each with its own router profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.types import PodId
from kvmesh.router.types import EndpointState

DEFAULT_DECAY = 0.98
"""Weight left to a sample after each newer one: the estimate follows about the last 50 samples."""
MIN_SAMPLE_WEIGHT = 8.0
"""Effective samples before the learned speed replaces the scorer's prior."""
DEFAULT_MIN_TOKENS = 1024
"""Prefill work below this many tokens teaches nothing about prefill speed."""


def prefill_work(start: int, end: int, attention_context: float) -> float:
    """Work of computing prompt positions ``[start, end)``, in tokens at position 0 (see above)."""
    n = max(end - start, 0)
    if attention_context <= 0 or n == 0:
        return float(n)
    return n + (end * end - start * start) / (2.0 * attention_context)


@dataclass(slots=True)
class PrefillSpeedFit:
    """Seconds per prefill token: exponentially weighted seconds over exponentially weighted tokens."""

    decay: float = DEFAULT_DECAY
    min_tokens: int = DEFAULT_MIN_TOKENS
    weight: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        if tokens < self.min_tokens or seconds <= 0:
            return
        d = self.decay
        self.weight = self.weight * d + 1.0
        self.tokens = self.tokens * d + tokens
        self.seconds = self.seconds * d + seconds

    def seconds_per_token(self) -> float:
        """The learned cost, or 0.0 while there are too few samples."""
        if self.weight < MIN_SAMPLE_WEIGHT or self.tokens <= 0:
            return 0.0
        return self.seconds / self.tokens


@dataclass(slots=True)
class _Open:
    backlog: _Backlog
    tokens: float
    ahead: float
    sent_s: float


@dataclass(slots=True)
class _Backlog:
    """One endpoint's outstanding work: what is open, and what is probably left of it."""

    state: EndpointState
    open_tokens: float = 0.0
    left: float = 0.0
    """``open_tokens`` less what the endpoint has computed since, at the learned speed: a request
    half-way through its prefill holds the next one back by half its tokens, not all of them."""
    at: float = 0.0

    def publish(self) -> None:
        self.state.pending_prefill_tokens = round(self.left)


class PrefillLedger:
    """Outstanding prefill tokens per endpoint and the pool's prefill speed learned from first tokens.

    Call :meth:`refresh` before each decision so the endpoints' ``pending_prefill_tokens`` reflect
    the work done since the last one.

    Args:
        learn: learn ``seconds_per_prefill_token`` from first-token times (off: the prior only).
        decay: forgetting factor of the estimate, per sample.
        min_tokens: least prefill work (tokens ahead + own) a sample needs to count.
        attention_context: context at which attention doubles a token's cost (0: plain tokens).
    """

    def __init__(
        self,
        *,
        learn: bool = True,
        decay: float = DEFAULT_DECAY,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        attention_context: float = 0.0,
    ) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if attention_context < 0:
            raise ValueError(f"attention_context must be non-negative, got {attention_context}")
        self.learn = learn
        self.attention_context = attention_context
        self._open: dict[str, _Open] = {}
        self._fit = PrefillSpeedFit(decay, min_tokens)
        self._backlogs: dict[PodId, _Backlog] = {}

    def __len__(self) -> int:
        return len(self._open)

    def refresh(self, now: float) -> None:
        """Drain every endpoint's remaining work by what it computed since the last refresh."""
        spt = self._fit.seconds_per_token()
        for backlog in self._backlogs.values():
            if spt > 0 and backlog.left > 0:
                backlog.left = max(backlog.left - (now - backlog.at) / spt, 0.0)
                backlog.publish()
            backlog.at = now

    def sent(
        self, request_id: str, state: EndpointState, tokens: int, now: float, *, cached: int = 0
    ) -> None:
        """``request_id`` went to ``state``'s endpoint, which must compute ``tokens`` prompt tokens
        after the ``cached`` ones it holds."""
        cached = max(cached, 0)
        work = prefill_work(cached, cached + max(tokens, 0), self.attention_context)
        self._release(request_id)
        backlog = self._backlogs.get(state.pod)
        if backlog is None or backlog.state is not state:  # new, or re-added to the pool
            backlog = self._backlogs[state.pod] = _Backlog(state, at=now)
            state.seconds_per_prefill_token = self._fit.seconds_per_token()
        self._open[request_id] = _Open(backlog, work, backlog.left, now)
        backlog.open_tokens += work
        backlog.left += work
        backlog.publish()

    def first_token(self, request_id: str, now: float) -> None:
        """The request's first token arrived: its work is done and its wait is a speed sample."""
        entry = self._release(request_id)
        if entry is None or not self.learn:
            return
        work = entry.ahead + entry.tokens
        if work <= 0:
            return
        self._fit.add(work, now - entry.sent_s)
        learned = self._fit.seconds_per_token()
        for backlog in self._backlogs.values():
            backlog.state.seconds_per_prefill_token = learned

    def finished(self, request_id: str) -> None:
        """The request ended (or failed) without a first-token sample: release its work."""
        self._release(request_id)

    def _release(self, request_id: str) -> _Open | None:
        entry = self._open.pop(request_id, None)
        if entry is not None:
            backlog = entry.backlog
            backlog.open_tokens = max(backlog.open_tokens - entry.tokens, 0)
            backlog.left = min(backlog.left, backlog.open_tokens)
            backlog.publish()
        return entry
