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

How fast prompts are prefilled, and the work a prompt is counted as, is fitted in
:mod:`kvmesh.router.prefill_speed`; how fast each endpoint frees KV, in :mod:`kvmesh.router.kv_release`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.types import PodId
from kvmesh.router.kv_forecast import KVReleaseForecast
from kvmesh.router.kv_release import KVReleaseRates
from kvmesh.router.prefill_speed import (
    DEFAULT_DECAY,
    DEFAULT_MAX_CONTEXT_RATIO,
    DEFAULT_MIN_TOKENS,
    PrefillSpeedFit,
    prefill_pairs,
    work_of,
)
from kvmesh.router.session_contexts import SessionContexts
from kvmesh.router.types import EndpointState


@dataclass(slots=True)
class _Open:
    backlog: _Backlog
    tokens: float
    pairs: float
    ahead: float
    """The endpoint's work left when it was sent, at ``context``."""
    ahead_pairs: float
    """The token pairs in ``ahead``."""
    context: float
    sent_s: float
    kv_tokens: int = 0
    """The prompt's whole length: the device KV it needs once admitted."""


@dataclass(slots=True)
class _Backlog:
    """One endpoint's outstanding work: what is open, and what is probably left of it."""

    state: EndpointState
    open_tokens: float = 0.0
    open_pairs: float = 0.0
    open_work: float = 0.0
    """``open_tokens`` and ``open_pairs`` in work at the ledger's attention context."""
    left: float = 0.0
    """``open_work`` less what the endpoint has computed since, at the learned speed: a request
    half-way through its prefill holds the next one back by half its work, not all of it."""
    at: float = 0.0
    open_kv_tokens: int = 0
    """The open requests' whole prompts: KV they take when the engine admits them."""
    num_open: int = 0
    """Requests open here: a copy's recompute delays about as many arriving after it."""

    def publish(self) -> None:
        self.state.pending_prefill_tokens = round(self.left)
        self.state.pending_kv_tokens = self.open_kv_tokens
        self.state.pending_prefills = self.num_open

    def reprice(self, attention_context: float) -> None:
        """The attention context changed: price the open work anew, keeping the share left."""
        work = work_of(self.open_tokens, self.open_pairs, attention_context)
        self.left = self.left * work / self.open_work if self.open_work > 0 else 0.0
        self.open_work = work
        self.publish()


class PrefillLedger:
    """Outstanding prefill work per endpoint, and the pool's prefill speed and attention context
    learned from first tokens.

    Call :meth:`refresh` before each decision so the endpoints' ``pending_prefill_tokens`` reflect
    the work done since the last one.

    Args:
        learn: learn ``seconds_per_prefill_token`` (and with ``learn_context``,
            ``attention_context_tokens``) from first-token times (off: the priors only).
        decay: forgetting factor of the estimate, per sample.
        min_tokens: least prefill work (tokens ahead + own) a sample needs to count.
        attention_context: context at which attention doubles a token's cost (0: plain tokens);
            the prior of the learned one.
        learn_context: learn the attention context (with ``learn`` and a positive prior).
        max_context_ratio: the learned attention context stays within this factor of the prior.
        session_idle_s: keep the live sessions of each endpoint (``sessions``), a session not
            seen for this long no longer counting in its ``session_kv_tokens``; ``None``: not kept
            (no price reads them).

    Raises:
        ValueError: ``decay`` outside (0, 1], a negative ``attention_context``, a
            ``max_context_ratio`` below 1 or a non-positive ``session_idle_s``.
    """

    def __init__(
        self,
        *,
        learn: bool = True,
        decay: float = DEFAULT_DECAY,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        attention_context: float = 0.0,
        learn_context: bool = True,
        max_context_ratio: float = DEFAULT_MAX_CONTEXT_RATIO,
        session_idle_s: float | None = None,
    ) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if attention_context < 0:
            raise ValueError(f"attention_context must be non-negative, got {attention_context}")
        if max_context_ratio < 1.0:
            raise ValueError(f"max_context_ratio must be at least 1, got {max_context_ratio}")
        self.learn = learn
        self.attention_context = attention_context
        """The prior."""
        self._context = attention_context
        """The attention context backlogs are priced at: the learned one once known."""
        self._open: dict[str, _Open] = {}
        self._fit = PrefillSpeedFit(decay, min_tokens, attention_context, learn_context, max_context_ratio)
        self._learned: tuple[float, float] = (0.0, 0.0)
        self._backlogs: dict[PodId, _Backlog] = {}
        self.kv_release = KVReleaseRates()
        """How fast each endpoint frees device KV, from the requests seen to end there."""
        self.kv_forecast = KVReleaseForecast()
        """When each endpoint's running answers free their KV."""
        self.sessions = None if session_idle_s is None else SessionContexts(session_idle_s)
        """The live sessions each endpoint holds (the caller reports each routed request)."""

    def __len__(self) -> int:
        return len(self._open)

    @property
    def seconds_per_token(self) -> float:
        """The learned seconds per token at position 0 (0.0 until learned)."""
        return self._learned[0]

    @property
    def attention_context_tokens(self) -> float:
        """The learned attention context (0.0 until learned, or when not learned at all)."""
        return self._learned[1]

    def refresh(self, now: float) -> None:
        """Drain every endpoint's remaining work by what it computed since the last refresh (and
        age the KV release rates)."""
        self.kv_release.refresh(now)
        self.kv_forecast.refresh(now)
        if self.sessions is not None:
            self.sessions.expire(now)
        spt = self._learned[0]
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
        n = max(tokens, 0)
        pairs = prefill_pairs(cached, cached + n) if self.attention_context > 0 else 0.0
        work = work_of(n, pairs, self._context)
        self._release(request_id)
        backlog = self._backlogs.get(state.pod)
        if backlog is None or backlog.state is not state:  # new, or re-added to the pool
            backlog = self._backlogs[state.pod] = _Backlog(state, at=now)
            state.seconds_per_prefill_token, state.attention_context_tokens = self._learned
            self.kv_release.watch(state, now)
        share = backlog.left / backlog.open_work if backlog.open_work > 0 else 0.0
        self._open[request_id] = _Open(
            backlog, n, pairs, backlog.left, backlog.open_pairs * share, self._context, now, cached + n
        )
        backlog.open_tokens += n
        backlog.open_kv_tokens += cached + n
        backlog.num_open += 1
        backlog.open_pairs += pairs
        backlog.open_work += work
        backlog.left += work
        backlog.publish()

    def first_token(self, request_id: str, now: float) -> None:
        """The request's first token arrived: its work is done and its wait is a speed sample."""
        entry = self._release(request_id)
        if entry is None:
            return
        self.kv_forecast.started(entry.backlog.state, request_id, entry.kv_tokens, now)
        if not self.learn:
            return
        prior = self.attention_context
        ahead = entry.ahead
        if entry.context != prior:  # priced at a learned context: the fit counts work at the prior
            ahead = work_of(max(ahead - entry.ahead_pairs / entry.context, 0.0), entry.ahead_pairs, prior)
        work = ahead + work_of(entry.tokens, entry.pairs, prior)
        if work <= 0:
            return
        self._fit.add(work, now - entry.sent_s, entry.ahead_pairs + entry.pairs)
        self._learned = learned = self._fit.estimate()
        context = learned[1] or self.attention_context
        if context != self._context:
            self._context = context
            for backlog in self._backlogs.values():
                backlog.reprice(context)
        for backlog in self._backlogs.values():
            backlog.state.seconds_per_prefill_token, backlog.state.attention_context_tokens = learned

    def released(self, request_id: str, state: EndpointState, prompt_tokens: int, now: float) -> None:
        """``request_id``, whose prompt held ``prompt_tokens`` of device KV, ended at ``state``'s
        endpoint (its answer is over): the KV it frees teaches the endpoint's release rate, and its
        duration the release forecast."""
        self.kv_release.released(state, prompt_tokens, now)
        self.kv_forecast.ended(state, request_id, now)

    def finished(self, request_id: str) -> None:
        """The request ended (or failed) without a first-token sample: release its work."""
        self._release(request_id)

    def _release(self, request_id: str) -> _Open | None:
        entry = self._open.pop(request_id, None)
        if entry is not None:
            backlog = entry.backlog
            backlog.open_tokens = max(backlog.open_tokens - entry.tokens, 0.0)
            backlog.open_kv_tokens = max(backlog.open_kv_tokens - entry.kv_tokens, 0)
            backlog.num_open = max(backlog.num_open - 1, 0)
            backlog.open_pairs = max(backlog.open_pairs - entry.pairs, 0.0)
            work = work_of(entry.tokens, entry.pairs, self._context)
            backlog.open_work = max(backlog.open_work - work, 0)
            backlog.left = min(backlog.left, backlog.open_work)
            backlog.publish()
        return entry
