# Over 450 lines: the built-in scorers, each a small class with its factory, kept in one module that the registry reads; the TTFT estimate, the largest, is the one to split out next.
"""Scorers: rate each candidate endpoint in [0, 1] (higher is better)."""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.errors import ConfigError
from kvmesh.router.known_prefix import prompt_block_keys
from kvmesh.router.plugins.base import Params, PluginContext, Scorer
from kvmesh.router.plugins.kv_admission import KVAdmissionPrice
from kvmesh.router.plugins.shared_prefix_ends import SharedPrefixEnds
from kvmesh.router.prefill_speed import DEFAULT_MAX_CONTEXT_RATIO, prefill_work
from kvmesh.router.prefix import DEFAULT_TIER_WEIGHTS, weighted_blocks
from kvmesh.router.types import EndpointState, PrefixMatch, RoutingRequest


def _tier_map(
    plugin: str, raw: Mapping[str, object], defaults: Mapping[Medium, float]
) -> dict[Medium, float]:
    out = dict(defaults)
    for name, value in raw.items():
        try:
            tier = Medium(str(name).upper())
        except ValueError as exc:
            raise ConfigError(f"plugin {plugin!r}: unknown tier {name!r} (GPU, CPU, DISK, SHARED)") from exc
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"plugin {plugin!r}: tier {name} needs a non-negative number, got {value!r}")
        out[tier] = float(value)
    return out


def _min_max_inverse(values: list[float] | list[int]) -> list[float]:
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]


@dataclass(slots=True)
class PrecisePrefixScorer:
    """Share of the prompt's blocks an endpoint holds as a consecutive prefix, by tier weight.

    Reads ``request.prefix``, which the scheduler fills from the event-fed block index.
    """

    tier_weights: dict[Medium, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))

    @property
    def scores_in_unit_range(self) -> bool:
        """Matched blocks over prompt blocks, each worth at most its tier weight."""
        return all(0.0 <= w <= 1.0 for w in self.tier_weights.values())

    def score(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[float]:
        prefix = request.prefix
        if prefix is None or prefix.num_blocks == 0 or not (prefix.pods or prefix.shared):
            return [0.0] * len(endpoints)
        total = prefix.num_blocks
        pods = prefix.pods
        weights = self.tier_weights
        shared = 0.0 if prefix.shared is None else weighted_blocks(prefix.shared, weights) / total
        if len(pods) == 1:  # often the answer under prefix-aware routing: one pod holds it
            ((holder, held),) = pods.items()
            only = weighted_blocks(held, weights) / total
            return [only if e.pod == holder else shared for e in endpoints]
        return [
            shared if (match := pods.get(e.pod)) is None else weighted_blocks(match, weights) / total
            for e in endpoints
        ]


@dataclass(slots=True)
class ApproximatePrefixScorer:
    """Prefix share predicted from the router's own routing history (no KV events needed).

    Every routed prompt's blocks (of ``block_size`` tokens, its own granularity) are remembered
    for the chosen endpoint in an LRU of ``capacity`` blocks.

    With ``beyond_cache`` it scores only the part of the remembered prefix that no endpoint's own
    cache holds now (``request.prefix``, from the event-fed index): where every cache has lost a
    prefix, it goes back to the endpoint it was sent to before, so prefixes that outgrow the fleet's
    KV stay partitioned over the endpoints instead of landing wherever is idlest and evicting
    others; where a cache still holds it, the precise scorer alone decides. A prompt some cache
    holds whole is then neither hashed nor recorded (the index knows where it is). The shared tier
    does not count as a cache here: every endpoint could load from it, but each load costs a
    transfer and evicts something, so a prefix it holds still goes back where it went before.
    """

    scores_in_unit_range: ClassVar[bool] = True
    """Matched blocks over prompt blocks."""

    block_size: int
    capacity: int
    algo: HashAlgo = HashAlgo.XXH3
    beyond_cache: bool = False
    _history: OrderedDict[BlockKey, dict[PodId, None]] = field(default_factory=OrderedDict)
    _holder_maps: dict[tuple[PodId, ...], dict[PodId, None]] = field(default_factory=dict)
    """One read-only map per set of endpoints (in order), shared by every history block it names."""
    _hashers: dict[Namespace, BlockHasher] = field(default_factory=dict)
    _last: tuple[str, list[BlockKey]] | None = None
    _cached: tuple[PrefixMatch | None, float] = (None, 0.0)

    def _cached_blocks(self, request: RoutingRequest) -> float:
        """With ``beyond_cache``: the longest prefix any cache holds, in history blocks (else 0).
        Asked by score, then by observe, of the same match."""
        prefix = request.prefix
        if self._cached[0] is prefix:
            return self._cached[1]
        cached = 0.0
        if self.beyond_cache and prefix is not None:
            cached = prefix.longest_own_blocks() * prefix.block_size / self.block_size
        self._cached = (prefix, cached)
        return cached

    def _cached_whole(self, request: RoutingRequest) -> bool:
        cached = self._cached_blocks(request)
        return cached > 0 and cached >= request.num_tokens // self.block_size

    def _keys(self, request: RoutingRequest) -> list[BlockKey]:
        if self._last is not None and self._last[0] == request.request_id:
            return self._last[1]
        hasher = self._hashers.get(request.namespace)
        if hasher is None:
            hasher = self._hashers[request.namespace] = BlockHasher(
                request.namespace, self.block_size, self.algo
            )
        keys = prompt_block_keys(hasher, request.tokens, request.known_prefix)
        self._last = (request.request_id, keys)
        return keys

    def score(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[float]:
        if self._cached_whole(request):
            return [0.0] * len(endpoints)
        keys = self._keys(request)
        if not keys:
            return [0.0] * len(endpoints)
        matched: dict[PodId, int] = {}
        alive: set[PodId] | None = None
        depth = 0  # run by run of equal holder maps, which leave the alive pods as they are
        for holders, run in itertools.groupby(map(self._history.get, keys)):
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders.keys()
            if not alive:
                break
            depth += len(list(run))
            for pod in alive:
                matched[pod] = depth
        total = len(keys)
        cached = self._cached_blocks(request)
        return [max(matched.get(e.pod, 0) - cached, 0.0) / total for e in endpoints]

    def observe(self, request: RoutingRequest, pod: PodId) -> None:
        if self._cached_whole(request):
            return
        history = self._history
        only = self._holder_map((pod,))
        for key in self._keys(request):
            holders = history.get(key)
            if holders is None:
                history[key] = only
            else:
                if pod not in holders:
                    history[key] = self._holder_map((*holders, pod))
                history.move_to_end(key)
        while len(history) > self.capacity:
            history.popitem(last=False)

    def _holder_map(self, pods: tuple[PodId, ...]) -> dict[PodId, None]:
        found = self._holder_maps.get(pods)
        if found is None:
            if len(self._holder_maps) >= 4096:
                self._holder_maps.clear()  # maps in use stay valid, only no longer shared
            found = self._holder_maps[pods] = dict.fromkeys(pods)
        return found


@dataclass(slots=True)
class QueueScorer:
    """Shorter engine queue (``vllm:num_requests_waiting``) is better; min-max normalized."""

    scores_in_unit_range: ClassVar[bool] = True
    """Min-max normalized."""

    def score(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[float]:
        return _min_max_inverse([e.waiting for e in endpoints])


@dataclass(slots=True)
class KVCacheUtilizationScorer:
    """Emptier device KV cache is better: ``1 - kv_cache_usage``."""

    scores_in_unit_range: ClassVar[bool] = True
    """Endpoint states hold usage in [0, 1] (the scraper clamps it)."""

    def score(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[float]:
        return [1.0 - e.kv_cache_usage for e in endpoints]


@dataclass(slots=True)
class ActiveRequestScorer:
    """Fewer requests in flight from this router is better: ``(max - n) / max``."""

    scores_in_unit_range: ClassVar[bool] = True
    """In-flight counts are never negative."""

    def score(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[float]:
        top = max((e.in_flight for e in endpoints), default=0)
        if top <= 0:
            return [1.0] * len(endpoints)
        return [(top - e.in_flight) / top for e in endpoints]


@dataclass(slots=True)
class SessionAffinityScorer:
    """1 for the endpoint that served this ``x-session-id`` last, 0 elsewhere."""

    scores_in_unit_range: ClassVar[bool] = True
    """Zeros and a one."""

    capacity: int
    _sessions: OrderedDict[str, PodId] = field(default_factory=OrderedDict)

    def score(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[float]:
        if request.session_id is None:
            return [0.0] * len(endpoints)
        pod = self._sessions.get(request.session_id)
        return [1.0 if e.pod == pod else 0.0 for e in endpoints]

    def observe(self, request: RoutingRequest, pod: PodId) -> None:
        if request.session_id is None:
            return
        self._sessions[request.session_id] = pod
        self._sessions.move_to_end(request.session_id)
        if len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)


@dataclass(slots=True)
class RandomScorer:
    """A uniform random score per endpoint."""

    scores_in_unit_range: ClassVar[bool] = True
    """Uniform draws in [0, 1)."""

    rng: random.Random

    def score(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[float]:
        return [self.rng.random() for _ in endpoints]


@dataclass(slots=True)
class RoundRobinScorer:
    """1 for the next endpoint in pod-id order, 0 elsewhere; advances on each decision."""

    scores_in_unit_range: ClassVar[bool] = True
    """Zeros and a one."""

    _turn: int = 0

    def score(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[float]:
        if not endpoints:
            return []
        pods = sorted(e.pod for e in endpoints)
        target = pods[self._turn % len(pods)]
        return [1.0 if e.pod == target else 0.0 for e in endpoints]

    def observe(self, request: RoutingRequest, pod: PodId) -> None:
        self._turn += 1


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
    - KV: the wait for free KV and the recompute of what the new tokens evict (``kv_price``).

    A prefix's holder wins while its backlog costs less than recomputing the prefix elsewhere; once
    it is saturated, the next request for that prefix goes to where it finishes first and becomes a
    second copy (or loads the prefix from a shared tier) instead of queueing.
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
        return self._estimate(request.prefix, request.num_tokens, kv_priced, kv_wait, endpoint)

    def _estimate(
        self, prefix: PrefixMatch | None, num: int, kv_priced: bool, kv_wait: bool, endpoint: EndpointState
    ) -> float:
        transfer = 0.0
        cached = 0
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
        budget = self.max_batched_tokens
        share = max(budget - endpoint.running, budget * 0.1) / budget
        spt = self.seconds_per_token(endpoint) / share
        context = self.attention_context_tokens(endpoint)
        if context > 0:
            start = min(cached, num - 1)  # a full hit still computes the last token
            own = max(prefill_work(start, num, context), 1.0)
        else:
            own = max(num - cached, 1)
        queue = max(endpoint.pending_prefill_tokens * spt, endpoint.waiting * self.queued_request_s)
        if kv_priced:
            queue += self.kv_price.seconds(endpoint, num, num - cached, spt, wait=kv_wait)
        return transfer + queue + own * spt

    def score(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[float]:
        prefix, num, kv_priced = request.prefix, request.num_tokens, self.kv_price.enabled
        kv_wait = not (self.kv_price.learned_wait and self.shared_ends.shared(request))
        estimates = [self._estimate(prefix, num, kv_priced, kv_wait, e) for e in endpoints]
        if not estimates:
            return []
        best = min(estimates)
        return [1.0 if est <= 0.0 else best / est for est in estimates]


DEFAULT_TIER_GBPS: dict[Medium, float] = {
    Medium.GPU: 0.0,
    Medium.CPU: 16.0,
    Medium.DISK: 2.0,
    Medium.SHARED: 10.0,
}


def make_precise_prefix_scorer(name: str, params: Params, ctx: PluginContext) -> PrecisePrefixScorer:
    return PrecisePrefixScorer(_tier_map(name, params.mapping("tierWeights"), DEFAULT_TIER_WEIGHTS))


def make_approximate_prefix_scorer(name: str, params: Params, ctx: PluginContext) -> ApproximatePrefixScorer:
    return ApproximatePrefixScorer(
        block_size=params.integer("blockSize", 64, minimum=1),
        capacity=params.integer("lruCapacity", 500_000, minimum=1),
        algo=HashAlgo(params.string("hashAlgo", HashAlgo.XXH3.value)),
        beyond_cache=params.boolean("beyondCache", False),
    )


def make_queue_scorer(name: str, params: Params, ctx: PluginContext) -> QueueScorer:
    return QueueScorer()


def make_kv_cache_utilization_scorer(
    name: str, params: Params, ctx: PluginContext
) -> KVCacheUtilizationScorer:
    return KVCacheUtilizationScorer()


def make_active_request_scorer(name: str, params: Params, ctx: PluginContext) -> ActiveRequestScorer:
    return ActiveRequestScorer()


def make_session_affinity_scorer(name: str, params: Params, ctx: PluginContext) -> SessionAffinityScorer:
    return SessionAffinityScorer(params.integer("maxSessions", 100_000, minimum=1))


def make_random_scorer(name: str, params: Params, ctx: PluginContext) -> RandomScorer:
    return RandomScorer(ctx.rng)


def make_round_robin_scorer(name: str, params: Params, ctx: PluginContext) -> RoundRobinScorer:
    return RoundRobinScorer()


def make_ttft_estimate_scorer(name: str, params: Params, ctx: PluginContext) -> TTFTEstimateScorer:
    return TTFTEstimateScorer(
        prefill_tokens_per_s=params.number("prefillTokensPerSecond", 8000.0, minimum=1e-9),
        queued_request_s=params.number("queuedRequestSeconds", 0.05, minimum=0.0),
        kv_bytes_per_token=params.number("kvBytesPerToken", 36_864.0, minimum=0.0),
        tier_gbps=_tier_map(name, params.mapping("tierGBps"), DEFAULT_TIER_GBPS),
        max_batched_tokens=params.integer("maxBatchedTokens", 8192, minimum=1),
        max_learned_ratio=params.number("maxLearnedRatio", 10.0, minimum=1.0),
        attention_context=params.number("attentionContextTokens", 0.0, minimum=0.0),
        learn_context=params.boolean("learnAttentionContext", True),
        max_context_ratio=params.number("maxLearnedContextRatio", DEFAULT_MAX_CONTEXT_RATIO, minimum=1.0),
        kv_price=KVAdmissionPrice.from_params(params),
    )


def _conforms(
    a: PrecisePrefixScorer,
    b: ApproximatePrefixScorer,
    c: QueueScorer,
    d: KVCacheUtilizationScorer,
    e: ActiveRequestScorer,
    f: SessionAffinityScorer,
    g: RandomScorer,
    h: RoundRobinScorer,
    i: TTFTEstimateScorer,
) -> list[Scorer]:
    return [a, b, c, d, e, f, g, h, i]
