"""Scorers: rate each candidate endpoint in [0, 1] (higher is better)."""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import ClassVar

from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.router.known_prefix import prompt_block_keys
from kvmesh.router.plugins.base import Params, PluginContext, Scorer, tier_map
from kvmesh.router.prefix import DEFAULT_TIER_WEIGHTS, weighted_blocks
from kvmesh.router.types import EndpointState, PrefixMatch, RoutingRequest


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


def make_precise_prefix_scorer(name: str, params: Params, ctx: PluginContext) -> PrecisePrefixScorer:
    return PrecisePrefixScorer(tier_map(name, params.mapping("tierWeights"), DEFAULT_TIER_WEIGHTS))


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


def _conforms(
    a: PrecisePrefixScorer,
    b: ApproximatePrefixScorer,
    c: QueueScorer,
    d: KVCacheUtilizationScorer,
    e: ActiveRequestScorer,
    f: SessionAffinityScorer,
    g: RandomScorer,
    h: RoundRobinScorer,
) -> list[Scorer]:
    return [a, b, c, d, e, f, g, h]
