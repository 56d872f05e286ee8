"""LoRA placement: send an adapter's requests where the adapter is loaded, spread it when those
endpoints saturate, and price an adapter swap on endpoints whose batch slots are full.

Both plugins pass base-model requests (``request.namespace.lora`` empty) through untouched: the
filter keeps every endpoint and the scorer gives every endpoint 1.

An endpoint is *saturated* when more than ``maxWaiting`` requests queue there or its KV cache is
fuller than ``kvCacheThreshold``. An adapter is *active* on an endpoint when requests with it run or
wait there (``vllm:lora_requests_info``), or when this profile sent it one since the endpoint's last
metrics scrape: a burst of one adapter's requests then stays on the endpoint the first one chose
instead of loading the adapter everywhere before the metrics catch up. An endpoint has a *free slot*
when fewer than ``max_lora`` adapters are active, so one more joins the batch without waiting for
another to drain.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvmesh.core.types import PodId
from kvmesh.router.lora_state import LoraState
from kvmesh.router.plugins.base import Filter, Observer, Params, PluginContext, Scorer
from kvmesh.router.types import EndpointState, RoutingRequest


@dataclass(slots=True)
class Saturation:
    """When an endpoint counts as saturated."""

    max_waiting: int = 4
    kv_cache_threshold: float = 0.9

    def of(self, endpoint: EndpointState) -> bool:
        """Whether ``endpoint`` has more queued requests or KV fill than it should take more of."""
        return endpoint.waiting > self.max_waiting or endpoint.kv_cache_usage > self.kv_cache_threshold


class Placement(enum.IntEnum):
    """Where an adapter's request would land on one endpoint, best last."""

    NOT_SERVED = 0
    SWAP = 1
    LOADED_SATURATED = 2
    FREE_SLOT = 3
    LOADED = 4


@dataclass(slots=True)
class SentAdapters:
    """Adapters sent to each endpoint since its last scrape.

    The pool replaces an endpoint's :class:`LoraState` on every scrape, so a note lives exactly as
    long as the state object it was taken against: no clock needed.
    """

    _notes: dict[PodId, tuple[LoraState, set[str]]] = field(default_factory=dict)
    _seen: dict[PodId, LoraState] = field(default_factory=dict)

    def active(self, pod: PodId, lora: LoraState) -> frozenset[str]:
        """``lora``'s active adapters plus those sent to ``pod`` since ``lora`` was scraped."""
        self._seen[pod] = lora
        note = self._notes.get(pod)
        if note is None or note[0] is not lora:
            return lora.active
        return lora.active | note[1]

    def record(self, adapter: str, pod: PodId) -> None:
        """Note that a request for ``adapter`` went to ``pod``."""
        lora = self._seen.get(pod)
        if not adapter or lora is None:
            return
        note = self._notes.get(pod)
        if note is None or note[0] is not lora:
            self._notes[pod] = (lora, {adapter})
        else:
            note[1].add(adapter)


@dataclass(slots=True)
class AdapterPlacer:
    """Classifies endpoints for an adapter's request; shared logic of the filter and the scorer."""

    saturation: Saturation
    sent: SentAdapters = field(default_factory=SentAdapters)

    def place(self, adapter: str, endpoint: EndpointState) -> Placement:
        """Where ``adapter`` would land on ``endpoint``."""
        lora = endpoint.lora
        if lora is None or not lora.can_serve(adapter):
            return Placement.NOT_SERVED
        active = self.sent.active(endpoint.pod, lora)
        if adapter in active:
            return Placement.LOADED_SATURATED if self.saturation.of(endpoint) else Placement.LOADED
        if lora.max_lora > 0 and len(active) >= lora.max_lora:
            return Placement.SWAP
        return Placement.LOADED_SATURATED if self.saturation.of(endpoint) else Placement.FREE_SLOT

    def observe(self, request: RoutingRequest, pod: PodId) -> None:
        """Record that ``request`` went to ``pod``."""
        self.sent.record(request.namespace.lora, pod)


@dataclass(slots=True)
class LoraAffinityFilter:
    """Keeps the endpoints that should serve an adapter's request, in this order of preference:

    1. endpoints with the adapter active that are not saturated;
    2. else endpoints that serve the adapter, have a free slot and are not saturated (spreading
       the adapter);
    3. else endpoints with the adapter active (saturated, but no swap), and saturated endpoints with
       a free slot;
    4. else every endpoint that serves the adapter (each must swap one out).

    When no endpoint lists the adapter, every endpoint is kept and the engine answers.
    """

    placer: AdapterPlacer

    def filter(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[EndpointState]:
        adapter = request.namespace.lora
        if not adapter:
            return endpoints
        placed = [(e, self.placer.place(adapter, e)) for e in endpoints]
        best = max(p for _, p in placed)
        if best is Placement.NOT_SERVED:
            return endpoints
        return [e for e, p in placed if p == best]

    def observe(self, request: RoutingRequest, pod: PodId) -> None:
        """Count the adapter active on ``pod`` until its next scrape."""
        self.placer.observe(request, pod)


@dataclass(slots=True)
class LoraAffinityScorer:
    """Scores an adapter's request per endpoint: ``loaded`` where the adapter is active and the
    endpoint not saturated, ``freeSlot`` where the adapter would take a free slot,
    ``loadedSaturated`` where the endpoint is saturated (and holds the adapter or has a slot),
    ``swap`` where every slot holds another adapter, and 0 where the endpoint does not serve it.
    With the defaults a saturated holder ranks below an endpoint with a free slot, which spreads the
    adapter."""

    placer: AdapterPlacer
    loaded: float = 1.0
    loaded_saturated: float = 0.4
    free_slot: float = 0.6
    swap: float = 0.2

    @property
    def scores_in_unit_range(self) -> bool:
        """Each score is one of the configured values, each checked to lie in [0, 1]."""
        return True

    def score(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[float]:
        adapter = request.namespace.lora
        if not adapter:
            return [1.0] * len(endpoints)
        values = {
            Placement.NOT_SERVED: 0.0,
            Placement.SWAP: self.swap,
            Placement.LOADED_SATURATED: self.loaded_saturated,
            Placement.FREE_SLOT: self.free_slot,
            Placement.LOADED: self.loaded,
        }
        return [values[self.placer.place(adapter, e)] for e in endpoints]

    def observe(self, request: RoutingRequest, pod: PodId) -> None:
        """Count the adapter active on ``pod`` until its next scrape."""
        self.placer.observe(request, pod)


def _saturation(params: Params) -> Saturation:
    kv = params.number("kvCacheThreshold", 0.9, minimum=0.0)
    if kv > 1.0:
        raise ValueError(f"kvCacheThreshold must be <= 1, got {kv}")
    return Saturation(params.integer("maxWaiting", 4, minimum=0), kv)


def _unit(params: Params, key: str, default: float) -> float:
    value = params.number(key, default, minimum=0.0)
    if value > 1.0:
        raise ValueError(f"{key} must be <= 1, got {value}")
    return value


def make_lora_affinity_filter(name: str, params: Params, ctx: PluginContext) -> LoraAffinityFilter:
    return LoraAffinityFilter(AdapterPlacer(_saturation(params)))


def make_lora_affinity_scorer(name: str, params: Params, ctx: PluginContext) -> LoraAffinityScorer:
    return LoraAffinityScorer(
        AdapterPlacer(_saturation(params)),
        loaded=_unit(params, "loaded", 1.0),
        loaded_saturated=_unit(params, "loadedSaturated", 0.4),
        free_slot=_unit(params, "freeSlot", 0.6),
        swap=_unit(params, "swap", 0.2),
    )


def _conforms(f: LoraAffinityFilter, s: LoraAffinityScorer) -> tuple[Filter, Scorer, Observer, Observer]:
    return f, s, f, s
