"""How fast an inference pool prefills, learned from first tokens, and the work a prompt is counted as.

Work is counted in tokens at position 0: a token at position ``p`` attends to ``p`` earlier ones, so
with ``attention_context`` ``C`` it costs ``1 + p / C`` of them (``C`` is where attention doubles a
token's cost: twice the parameters over the attention FLOPs per token pair; about 30k for Qwen3-32B).
Computing positions ``[start, end)`` is then ``n + q / C`` with ``n = end - start`` tokens and
``q = (end² - start²) / 2`` token pairs. A 190k-token cold prompt is about four times the work its
token count says, and the endpoint behind it is not reported idle while it is still prefilling.
``C = 0`` (the default) counts plain tokens; the ``ttft-estimate-scorer``'s ``attentionContextTokens``
sets it for the router's ledger.

``C`` is learned too, with the configured one as its prior ``C₀``. Every request's work is kept in
its two parts, ``n`` and ``q``, its own and its share of the endpoint's backlog ahead of it, and the
samples fit ``ttft ≈ a·n + b·q``: ``seconds_per_token = a`` and ``C = a / b``. Written around the
prior as ``ttft ≈ a·w + c·x``, with ``w = n + q/C₀`` the work at the prior and ``x = q/C₀`` its
attention part, ``c = 0`` is the prior, and ``C = C₀ · a / (a + c)`` solves the exponentially weighted
normal equations (each sample weighted ``g/w``, so that with ``c = 0`` and ``g = 1`` it is the ratio
of sums above)::

    | Σg·w    Σg·x           | |a|   | Σg·t       |
    | Σg·x    Σg·x²/w + Λ    | |c| = | Σg·x·t/w   |        Λ = (σ / 0.5)² · Σg·w / Σg

``Λ`` is the prior as pseudo-samples: ``c / a`` is taken to be within ±0.5 of 0 (``C`` within about
2/3 to 2× of the prior) at one standard deviation, against samples whose log ratio to the typical
speed spreads by ``σ`` (their weighted root mean square, at least 1 %). ``C`` so moves only as far
as the samples' spread in attention share ``x/w`` (long and short contexts, cold prompts and short
suffixes after long prefixes) tells it apart from the speed: with prompts of one length ``c`` stays 0
and ``C`` at the prior, and noisy samples of little spread barely move it. It is kept within
``max_context_ratio`` (4×) of the prior (``maxLearnedContextRatio``).

The weights ``g`` keep first tokens that the prefill model does not explain out of the fit: a wait for
KV, another router's prompts or a wrong guess of the work ahead makes a first token several times
later than its prefill, such delays come in runs, and a least-squares fit of two parameters through
them swings from bound to bound. Each sample's log ratio ``e`` of seconds to its work at the current
``C`` is measured from a running lower quartile of those ratios (delays only add) and weighs
``1 / (1 + (e / 2s)²)``, ``s`` their running median; one more than 3× late weighs 0, and while ``s`` is
above 30 % (most first tokens late: a fleet short of KV) no sample counts, so ``C`` keeps what it
learned. Older samples age by ``decay ** g``: a sample that hardly counts hardly ages the others.
The speed itself keeps every sample, late ones included, as before: it is what drains the backlogs,
and the delays are part of how fast a busy endpoint gets through its work; it is the ratio of sums
with the work at the learned ``C`` (``Σt / Σ(w + (C₀/C - 1)·x)``).

The backlog drains at ``seconds_per_token`` in work units at the current ``C``; when the learned ``C``
moves, each endpoint's remaining work is re-priced from its open ``n`` and ``q``, keeping the share
left. Learning nothing of the context (``learn_context`` off, or no prior) leaves the speed and the
backlogs exactly as with a fixed ``C``.

The fit is pooled over the endpoints (an inference pool serves one model on one kind of hardware):
per-endpoint fits on a few dozen samples differ by noise, and routing on that noise sends a request
away from the endpoint holding its prefix for no reason. Heterogeneous hardware belongs in separate
pools, each with its own router profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_DECAY = 0.98
"""Weight left to a sample after each newer one: the estimate follows about the last 50 samples."""
MIN_SAMPLE_WEIGHT = 8.0
"""Effective samples before the learned speed replaces the scorer's prior."""
DEFAULT_MIN_TOKENS = 1024
"""Prefill work below this many tokens teaches nothing about prefill speed."""
DEFAULT_MAX_CONTEXT_RATIO = 4.0
"""The learned attention context stays within this factor of the prior."""
CONTEXT_PRIOR_SPREAD = 0.5
"""Standard deviation of the prior on ``c / a = C₀ / C - 1`` (module docstring)."""
OUTLIER_SCALE = 2.0
"""A sample whose log ratio is this many typical ones above the lower quartile weighs half."""
MIN_RESIDUAL_SCALE = 0.01
"""The typical log ratio is never taken below 1 %: a closer prediction is as good as exact."""
MAX_ERROR = math.log(3.0)
"""A first token more than 3× later than the typical one is a sample of something else."""
NOISY_SCALE = 0.3
"""While the typical log ratio is above 30 % most first tokens come late (a fleet short of KV, a
burst): the prefill model explains none of them, and the attention context keeps what it learned."""
MAX_RESIDUAL_SCALE = 1.0
"""The typical log ratio is never taken above 100 %, so it is back under ``NOISY_SCALE`` within
about 12 samples once the delays end."""
LEVEL_QUANTILE = 0.25
"""The typical seconds per unit of work is taken low: delays only add."""
RESIDUAL_SCALE_STEP = 0.1
"""Log step of the running median per sample: it follows a change within about 30 samples."""


def prefill_pairs(start: int, end: int) -> float:
    """Token pairs attended to in computing prompt positions ``[start, end)``: ``(end² - start²) / 2``,
    the part of the work that grows with the context (see above)."""
    if end <= start:
        return 0.0
    return (end * end - start * start) / 2.0


def work_of(tokens: float, pairs: float, attention_context: float) -> float:
    """``tokens + pairs / attention_context`` in tokens at position 0 (``attention_context`` 0: plain
    tokens)."""
    if attention_context <= 0:
        return float(tokens)
    return tokens + pairs / attention_context


def prefill_work(start: int, end: int, attention_context: float) -> float:
    """Work of computing prompt positions ``[start, end)``, in tokens at position 0 (see above)."""
    n = max(end - start, 0)
    if attention_context <= 0 or n == 0:
        return float(n)
    return work_of(n, prefill_pairs(start, end), attention_context)


@dataclass(slots=True)
class _Moments:
    """Exponentially weighted sums over samples of work ``w`` (at the prior context), its attention
    part ``x`` and seconds ``t``, each sample weighted ``g``."""

    weight: float = 0.0
    """Σ g."""
    work: float = 0.0
    """Σ g·w."""
    seconds: float = 0.0
    """Σ g·t."""
    attention: float = 0.0
    """Σ g·x."""
    attention_sq: float = 0.0
    """Σ g·x²/w."""
    attention_seconds: float = 0.0
    """Σ g·x·t/w."""
    error_sq: float = 0.0
    """Σ g·e², ``e`` the sample's log ratio to the typical seconds per unit of work."""

    def add(self, decay: float, g: float, work: float, seconds: float, x: float, error: float = 0.0) -> None:
        """Add a sample of weight ``g``, the older ones aged by ``decay ** g``."""
        if g != 1.0:
            decay **= g
        self.error_sq = self.error_sq * decay + g * error * error
        self.weight = self.weight * decay + g
        self.work = self.work * decay + g * work
        self.seconds = self.seconds * decay + g * seconds
        self.attention = self.attention * decay + g * x
        self.attention_sq = self.attention_sq * decay + g * x * x / work
        self.attention_seconds = self.attention_seconds * decay + g * x * seconds / work

    def seconds_per_token(self, k: float) -> float:
        """Σt over the work priced at context ``C``, ``Σ(w + k·x)`` with ``k = C₀ / C - 1``."""
        if k == 0.0:
            return self.seconds / self.work
        return self.seconds / (self.work + k * self.attention)

    def attention_context(self, prior: float, ratio: float, prior_weight: float) -> float:
        """The ridge solution of the module docstring's equations, as ``C`` within ``ratio`` of
        ``prior``; ``prior_weight`` is ``Λ`` per unit of mean work."""
        s1, s2, t1 = self.work, self.attention, self.seconds
        det = s1 * (self.attention_sq + prior_weight * s1 / self.weight) - s2 * s2
        if det <= 0:
            return prior
        c = (s1 * self.attention_seconds - s2 * t1) / det
        a = (t1 - s2 * c) / s1
        lo, hi = prior / ratio, prior * ratio
        if a <= 0:
            return lo if c > 0 else hi
        if a + c <= 0:
            return hi
        return min(max(prior * a / (a + c), lo), hi)


@dataclass(slots=True)
class PrefillSpeedFit:
    """Seconds per prefill token, and the attention context, fitted to first-token times.

    The speed is the exponentially weighted seconds over the exponentially weighted work, priced at
    the learned attention context where one is learned (a prior ``attention_context`` and
    ``learn_context``); that one solves the module docstring's normal equations over the typical
    samples.
    """

    decay: float = DEFAULT_DECAY
    min_tokens: int = DEFAULT_MIN_TOKENS
    attention_context: float = 0.0
    """The prior ``C₀`` (0: plain tokens, nothing to learn)."""
    learn_context: bool = True
    max_context_ratio: float = DEFAULT_MAX_CONTEXT_RATIO
    samples: _Moments = field(default_factory=_Moments)
    """Every sample, weight 1: the speed."""
    typical: _Moments = field(default_factory=_Moments)
    """Every sample, weighted by how typical its seconds per unit of work are: the attention context."""
    level: float | None = None
    """Running ``LEVEL_QUANTILE`` of ``log(t / work)``, the work at the learned context."""
    residual_scale: float = 0.1
    """Running median of ``|log(t / work) - level|``."""

    @property
    def weight(self) -> float:
        """Exponentially weighted count of samples."""
        return self.samples.weight

    @property
    def learns_context(self) -> bool:
        return self.learn_context and self.attention_context > 0

    def add(self, work: float, seconds: float, pairs: float = 0.0) -> None:
        """One sample: ``seconds`` to prefill ``work`` (tokens at position 0, at the prior attention
        context) with ``pairs`` token pairs of attention in it (:func:`prefill_pairs`), the work
        ahead of the request included."""
        if work <= 0 or work < self.min_tokens or seconds <= 0:
            return
        x = pairs / self.attention_context if self.attention_context > 0 else 0.0
        self.samples.add(self.decay, 1.0, work, seconds, x)
        if self.learns_context:
            self._add_typical(work, seconds, x)

    def _add_typical(self, work: float, seconds: float, x: float) -> None:
        """Add the sample to the attention context's fit with its weight (module docstring)."""
        context = self._context() if self.typical.weight > 0 else self.attention_context
        k = self.attention_context / context - 1.0
        ratio = math.log(seconds / (work + k * x))
        if self.level is None:
            self.level = ratio
            self.typical.add(self.decay, 1.0, work, seconds, x)
            return
        error = ratio - self.level
        scale = self.residual_scale
        self.level += scale * (LEVEL_QUANTILE if error > 0 else LEVEL_QUANTILE - 1.0)
        step = RESIDUAL_SCALE_STEP if abs(error) > scale else -RESIDUAL_SCALE_STEP
        self.residual_scale = min(max(scale * math.exp(step), MIN_RESIDUAL_SCALE), MAX_RESIDUAL_SCALE)
        if error > MAX_ERROR or scale > NOISY_SCALE:
            return
        g = 1.0 / (1.0 + (error / (OUTLIER_SCALE * scale)) ** 2)
        self.typical.add(self.decay, g, work, seconds, x, error)

    def _context(self) -> float:
        typical = self.typical
        noise = max(math.sqrt(typical.error_sq / typical.weight), MIN_RESIDUAL_SCALE)
        return typical.attention_context(
            self.attention_context, self.max_context_ratio, (noise / CONTEXT_PRIOR_SPREAD) ** 2
        )

    def seconds_per_token(self) -> float:
        """The learned cost of a token at position 0, or 0.0 while there are too few samples."""
        return self.estimate()[0]

    def attention_context_tokens(self) -> float:
        """The learned attention context, or 0.0 while there are too few samples or it is not
        learned (no prior, or ``learn_context`` off)."""
        return self.estimate()[1]

    def estimate(self) -> tuple[float, float]:
        """``(seconds_per_token, attention_context_tokens)``, each 0.0 where
        :meth:`seconds_per_token` and :meth:`attention_context_tokens` say."""
        if self.weight < MIN_SAMPLE_WEIGHT or self.samples.work <= 0:
            return 0.0, 0.0
        if not self.learns_context or self.typical.weight < MIN_SAMPLE_WEIGHT:
            return self.samples.seconds / self.samples.work, 0.0
        context = self._context()
        return self.samples.seconds_per_token(self.attention_context / context - 1.0), context
