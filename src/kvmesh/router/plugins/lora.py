"""LoRA placement: send an adapter's requests where the adapter is loaded, spread it when those
endpoints saturate, and price an adapter swap on endpoints whose batch slots are full.

Both plugins pass base-model requests (``request.namespace.lora`` empty) through untouched: the
filter keeps every endpoint and the scorer gives every endpoint 1.

An endpoint is *saturated* when more than ``maxWaiting`` requests queue there or its KV cache is
fuller than ``kvCacheThreshold``. An adapter is *active* on an endpoint when requests with it run or
wait there (``vllm:lora_requests_info``); an endpoint has a *free slot* when fewer than ``max_lora``
adapters are active, so one more joins the batch without waiting for another to drain.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.router.lora_state import LoraState
from kvmesh.router.plugins.base import Filter, Params, PluginContext, Scorer
from kvmesh.router.types import EndpointState, RoutingRequest


@dataclass(slots=True)
class Saturation:
    """When an endpoint counts as saturated."""

    max_waiting: int = 4
    kv_cache_threshold: float = 0.9

    def of(self, endpoint: EndpointState) -> bool:
        """Whether ``endpoint`` has more queued requests or KV fill than it should take more of."""
        return endpoint.waiting > self.max_waiting or endpoint.kv_cache_usage > self.kv_cache_threshold


def _servers(adapter: str, endpoints: list[EndpointState]) -> list[tuple[EndpointState, LoraState]]:
    return [(e, e.lora) for e in endpoints if e.lora is not None and e.lora.can_serve(adapter)]


@dataclass(slots=True)
class LoraAffinityFilter:
    """Keeps the endpoints that should serve an adapter's request, in this order of preference:

    1. endpoints with the adapter active that are not saturated;
    2. else endpoints that serve the adapter, have a free slot and are not saturated (spreading
       the adapter);
    3. else endpoints with the adapter active (saturated, but no swap);
    4. else every endpoint that serves the adapter (each must swap one out).

    When no endpoint lists the adapter, every endpoint is kept and the engine answers.
    """

    saturation: Saturation

    def filter(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[EndpointState]:
        adapter = request.namespace.lora
        if not adapter:
            return endpoints
        servers = _servers(adapter, endpoints)
        if not servers:
            return endpoints
        saturated = self.saturation.of
        active = [e for e, lora in servers if adapter in lora.active]
        hot = [e for e in active if not saturated(e)]
        if hot:
            return hot
        free = [
            e
            for e, lora in servers
            if adapter not in lora.active and lora.has_free_slot() and not saturated(e)
        ]
        if free:
            return free
        return active or [e for e, _ in servers]


@dataclass(slots=True)
class LoraAffinityScorer:
    """Scores an adapter's request per endpoint: ``loaded`` where the adapter is active and the
    endpoint not saturated, ``loadedSaturated`` where it is active but saturated, ``freeSlot`` where
    the adapter would take a free slot, ``swap`` where every slot holds another adapter, and 0 where
    the endpoint does not serve it. With the defaults a saturated holder ranks below an endpoint
    with a free slot, which spreads the adapter."""

    saturation: Saturation
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
        return [self._score_one(adapter, e) for e in endpoints]

    def _score_one(self, adapter: str, endpoint: EndpointState) -> float:
        lora = endpoint.lora
        if lora is None or not lora.can_serve(adapter):
            return 0.0
        if adapter in lora.active:
            return self.loaded_saturated if self.saturation.of(endpoint) else self.loaded
        return self.free_slot if lora.has_free_slot() else self.swap


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
    return LoraAffinityFilter(_saturation(params))


def make_lora_affinity_scorer(name: str, params: Params, ctx: PluginContext) -> LoraAffinityScorer:
    return LoraAffinityScorer(
        _saturation(params),
        loaded=_unit(params, "loaded", 1.0),
        loaded_saturated=_unit(params, "loadedSaturated", 0.4),
        free_slot=_unit(params, "freeSlot", 0.6),
        swap=_unit(params, "swap", 0.2),
    )


def _conforms(f: LoraAffinityFilter, s: LoraAffinityScorer) -> tuple[Filter, Scorer]:
    return f, s
