"""The TTFT-estimate scorer: each endpoint's predicted time to first token for the request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvmesh.core.types import Medium
from kvmesh.router.plugins.base import Params, PluginContext, Scorer, tier_map
from kvmesh.router.plugins.kv_admission import KVAdmissionPrice
from kvmesh.router.plugins.shared_prefix_ends import SharedPrefixEnds
from kvmesh.router.prefill_speed import DEFAULT_MAX_CONTEXT_RATIO, prefill_work
from kvmesh.router.session_contexts import DEFAULT_IDLE_S
from kvmesh.router.types import EndpointState, PrefixMatch, RoutingRequest


@dataclass(slots=True)
class TTFTEstimateScorer:
    """Predicted time to first token, scored as ``best_estimate / estimate``.

    ``estimate = transfer of cached blocks + queue + (work ahead + own uncached tokens) × s/token ÷ share``:

    - work ahead: the prompt tokens this router sent to the endpoint that have no first token yet
      (``pending_prefill_tokens``, exact at decision time);
    - own uncached tokens, weighted by position as the ledger weighs the work ahead (a token at
      position ``p`` costs ``1 + p / attention_context`` tokens at position 0; 0: plain tokens), so
      a long cold prompt is priced at what its attention costs, not at its token count; the
      attention context learned with the speed (``attention_context_tokens``) once known, else the
      configured one, a learned value kept within ``max_context_ratio`` of it;
    - queue: the engine's own ``waiting`` gauge × ``queued_request_s``, which also sees other
      routers' requests (the larger of the two waits counts, so this router's are not counted twice);
    - s/token: learned per endpoint from first-token times (``seconds_per_prefill_token``) once
      known, else ``1 / prefill_tokens_per_s``; a learned value is kept within ``max_learned_ratio``
      of that prior;
    - share: running decodes take one token each of every step's ``max_batched_tokens``;
    - transfer: blocks cached in a tier move at that tier's GB/s (0: no transfer, the device itself),
      at the KV bytes per token the endpoint reports (``kv_bytes_per_token`` where it reports none);
    - KV: the wait for free KV and the recompute of what the new tokens evict (``kv_price``); the
      tokens loaded from a lower tier need device KV as much as computed ones do;
    - a queued endpoint (in :meth:`score`): the prefill an endpoint needs beyond the least any
      candidate needs (the recompute a copy adds) is priced ``1 + queue_weight × q`` times, ``q``
      the requests this router sent there that have no first token yet (``pending_prefills``).
      That recompute also delays the requests that reach the endpoint while its backlog drains
      (about as many as wait there now), which the copy's own TTFT does not see. An idle endpoint
      prices it once (a session may still move to escape its holder's wait), and a cold prompt
      needs the same work everywhere and pays nothing more.

    A prefix's holder wins while its backlog costs less than recomputing the prefix elsewhere; once
    it is saturated, the next request for that prefix goes to where it finishes first and becomes a
    second copy (or loads the prefix from a shared tier) instead of queueing. The busier the
    other endpoints, the longer the holder's backlog has to be before a copy there pays.
    """

    scores_in_unit_range: ClassVar[bool] = True
    """Best estimate over each estimate, or 1."""

    prefill_tokens_per_s: float
    queued_request_s: float
    kv_bytes_per_token: float
    tier_gbps: dict[Medium, float]
    max_batched_tokens: int = 8192
    max_learned_ratio: float = 10.0
    attention_context: float = 0.0
    learn_context: bool = True
    """Whether the router's prefill ledger learns the attention context (``prefill_ledger_of``)."""
    max_context_ratio: float = DEFAULT_MAX_CONTEXT_RATIO
    kv_price: KVAdmissionPrice = field(default_factory=KVAdmissionPrice)
    queue_weight: float = 0.0
    """A copy's recompute is priced once more for every ``1 / queue_weight`` requests queued at
    the endpoint it would run on (0: not at all)."""
    session_idle_s: float = DEFAULT_IDLE_S
    """How long a session not seen still counts in its endpoint's ``session_kv_tokens`` (the
    router's prefill ledger keeps them: ``prefill_ledger_of``)."""
    shared_ends: SharedPrefixEnds = field(default_factory=SharedPrefixEnds)
    """Tells a hot shared prefix (not worth a second replica to skip a KV wait) from a session's own."""

    def seconds_per_token(self, endpoint: EndpointState) -> float:
        prior = 1.0 / self.prefill_tokens_per_s
        learned = endpoint.seconds_per_prefill_token
        if learned <= 0.0:
            return prior
        ratio = self.max_learned_ratio
        return min(max(learned, prior / ratio), prior * ratio)

    def attention_context_tokens(self, endpoint: EndpointState) -> float:
        """The attention context ``endpoint``'s prompt tokens are priced at (0: plain tokens)."""
        prior = self.attention_context
        learned = endpoint.attention_context_tokens
        if prior <= 0 or learned <= 0.0:
            return prior
        ratio = self.max_context_ratio
        return min(max(learned, prior / ratio), prior * ratio)

    def estimate(self, request: RoutingRequest, endpoint: EndpointState, *, kv_wait: bool = True) -> float:
        """Seconds until ``endpoint`` would emit the first token of ``request`` (``kv_wait``: with
        the learned wait for free KV, where the price has one)."""
        kv_priced = self.kv_price.enabled
        return self._estimate(request.prefix, request.num_tokens, kv_priced, kv_wait, endpoint)[0]

    def work_ahead(self, endpoint: EndpointState) -> float:
        """Seconds of work queued at ``endpoint`` before a new request's prefill: the estimate's
        queue term alone (no transfer, no KV price, none of the request's own work)."""
        return self._queue_s(endpoint, self._shared_seconds_per_token(endpoint))

    def _shared_seconds_per_token(self, endpoint: EndpointState) -> float:
        """Seconds per prompt token with the step's budget shared with running decodes."""
        budget = self.max_batched_tokens
        share = max(budget - endpoint.running, budget * 0.1) / budget
        return self.seconds_per_token(endpoint) / share

    def _queue_s(self, endpoint: EndpointState, spt: float) -> float:
        return max(endpoint.pending_prefill_tokens * spt, endpoint.waiting * self.queued_request_s)

    def _estimate(
        self, prefix: PrefixMatch | None, num: int, kv_priced: bool, kv_wait: bool, endpoint: EndpointState
    ) -> tuple[float, float, float]:
        """The estimate, the request's own work there (tokens at position 0) and the endpoint's
        seconds per such token."""
        transfer = 0.0
        cached = 0
        on_device = 0
        bytes_per_token = endpoint.kv_bytes_per_token or self.kv_bytes_per_token
        if prefix is not None:
            match = prefix.match_of(endpoint.pod)
            if match is not None:
                for tier, n in match.blocks_by_tier.items():
                    tokens = n * prefix.block_size
                    cached += tokens
                    gbps = self.tier_gbps.get(tier, 0.0)
                    if gbps > 0:
                        transfer += tokens * bytes_per_token / (gbps * 1e9)
                    else:
                        on_device += tokens
        spt = self._shared_seconds_per_token(endpoint)
        context = self.attention_context_tokens(endpoint)
        if context > 0:
            start = min(cached, num - 1)  # a full hit still computes the last token
            own = max(prefill_work(start, num, context), 1.0)
        else:
            own = max(num - cached, 1)
        queue = self._queue_s(endpoint, spt)
        if kv_priced:
            # a load from a lower tier takes device KV as a recompute does
            queue += self.kv_price.seconds(endpoint, num, num - on_device, spt, wait=kv_wait)
        return transfer + queue + own * spt, own, spt

    def score(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[float]:
        prefix, num, kv_priced = request.prefix, request.num_tokens, self.kv_price.enabled
        kv_wait = not (self.kv_price.learned_wait and self.shared_ends.shared(request))
        parts = [self._estimate(prefix, num, kv_priced, kv_wait, e) for e in endpoints]
        if not parts:
            return []
        weight = self.queue_weight
        if weight > 0:
            least = min(own for _, own, _ in parts)
            estimates = [
                est + weight * e.pending_prefills * (own - least) * spt
                for (est, own, spt), e in zip(parts, endpoints, strict=True)
            ]
        else:
            estimates = [est for est, _, _ in parts]
        best = min(estimates)
        return [1.0 if est <= 0.0 else best / est for est in estimates]


DEFAULT_TIER_GBPS: dict[Medium, float] = {
    Medium.GPU: 0.0,
    Medium.CPU: 16.0,
    Medium.DISK: 2.0,
    Medium.SHARED: 10.0,
}


def make_ttft_estimate_scorer(name: str, params: Params, ctx: PluginContext) -> TTFTEstimateScorer:
    return TTFTEstimateScorer(
        prefill_tokens_per_s=params.number("prefillTokensPerSecond", 8000.0, minimum=1e-9),
        queued_request_s=params.number("queuedRequestSeconds", 0.05, minimum=0.0),
        kv_bytes_per_token=params.number("kvBytesPerToken", 36_864.0, minimum=0.0),
        tier_gbps=tier_map(name, params.mapping("tierGBps"), DEFAULT_TIER_GBPS),
        max_batched_tokens=params.integer("maxBatchedTokens", 8192, minimum=1),
        max_learned_ratio=params.number("maxLearnedRatio", 10.0, minimum=1.0),
        attention_context=params.number("attentionContextTokens", 0.0, minimum=0.0),
        learn_context=params.boolean("learnAttentionContext", True),
        max_context_ratio=params.number("maxLearnedContextRatio", DEFAULT_MAX_CONTEXT_RATIO, minimum=1.0),
        kv_price=KVAdmissionPrice.from_params(params),
        queue_weight=params.number("recomputeQueueWeight", 0.0, minimum=0.0),
        session_idle_s=params.number("sessionIdleSeconds", DEFAULT_IDLE_S, minimum=1e-9),
    )


def _conforms(scorer: TTFTEstimateScorer) -> Scorer:
    return scorer
