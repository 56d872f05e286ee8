"""The router inside the simulator: the real scheduler, index and event applier, in virtual time.

Replicas' device-tier KV events go through the router's own :class:`EventApplier` (re-hashing the
events' token ids, exactly as for live engines) into its :class:`InMemoryIndex`; each arrival's
prefix is matched by :meth:`Scheduler.match` (with the block keys the simulator keeps per prompt)
and routed by :meth:`Scheduler.pick`. What differs from a live router is only where the endpoint gauges
come from: the simulator snapshots the replicas' queue and KV usage every ``metrics_interval_s`` of
virtual time, the way the gateway scrapes ``/metrics``, while ``in_flight`` (the router's own count)
is always current.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvmesh.core.events import KVEvent
from kvmesh.core.hashing import HashAlgo
from kvmesh.core.types import PodId
from kvmesh.errors import ConfigError
from kvmesh.router.flow_control import SaturationDetector, continues_cached_work
from kvmesh.router.index import InMemoryIndex
from kvmesh.router.ingest import EventApplier
from kvmesh.router.plugins.registry import TTFT_ESTIMATE_SCORER, prefill_ledger_of
from kvmesh.router.scheduler import PRESET_NAMES, Scheduler, load_scheduler_config
from kvmesh.router.types import EndpointState, RoutingRequest
from kvmesh.sim.replica import SimReplica, SimRequest

SIM_MODEL = "sim"
"""Model name in every simulated namespace (engines' caches and the router's applier agree on it)."""

SIM_HASH_ALGO = HashAlgo.XXH3


def with_cost_model_prior(
    config: Mapping[str, Any],
    *,
    prefill_tokens_per_s: float,
    queued_request_s: float,
    kv_bytes_per_token: int,
    shared_gbps: float,
    max_batched_tokens: int,
    attention_context_tokens: float = 0.0,
) -> dict[str, Any]:
    """``config`` with every ``ttft-estimate-scorer`` given the simulated GPU's figures as its prior.

    A live router starts from its YAML's prior and learns the pool's speed from first tokens; the
    simulator knows the engines' cost model, so its routers start where they would converge (GB/s
    per tier: CPU over PCIe, the shared tier over the network). A ``queuedRequestSeconds`` the
    config sets is kept: it is a policy choice as much as a hardware figure. A scorer that weighs
    prompt tokens by position (``attentionContextTokens`` > 0) gets the model's own figure.
    """
    out = dict(config)
    plugins = []
    for plugin in out.get("plugins") or []:
        if isinstance(plugin, Mapping) and plugin.get("type") == TTFT_ESTIMATE_SCORER:
            params = dict(plugin.get("parameters") or {})
            params.setdefault("queuedRequestSeconds", queued_request_s)
            params.update(
                prefillTokensPerSecond=prefill_tokens_per_s,
                kvBytesPerToken=float(kv_bytes_per_token),
                tierGBps={"GPU": 0.0, "CPU": 50.0, "DISK": 2.0, "SHARED": shared_gbps / 8},
                maxBatchedTokens=max_batched_tokens,
            )
            if attention_context_tokens > 0 and params.get("attentionContextTokens", 0) > 0:
                params["attentionContextTokens"] = attention_context_tokens
            plugin = {**plugin, "parameters": params}
        plugins.append(plugin)
    out["plugins"] = plugins
    return out


def resolve_policy(policy: str | Mapping[str, Any]) -> dict[str, Any]:
    """A scheduler config from a preset name, a YAML path or a mapping.

    Raises:
        ConfigError: unknown preset or unreadable file.
    """
    if isinstance(policy, Mapping):
        return dict(policy)
    if policy in PRESET_NAMES or Path(policy).is_file():
        return load_scheduler_config(policy)
    raise ConfigError(
        f"unknown policy {policy!r}; presets: {', '.join(PRESET_NAMES)}, or a scheduler YAML file"
    )


class SimRouter:
    """Routes simulated requests with the router's scheduler.

    With ``gateways`` > 1 the fleet sits behind that many router replicas and a load balancer that
    sends each request to one of them at random. Every replica subscribes to every engine's KV events,
    so the event-fed index is one shared index; what each replica keeps to itself is the state of its
    own plugins (the approximate scorer's routing history, round-robin position, random source) and
    its in-flight counts.

    Args:
        scheduler_config: parsed scheduler YAML (``plugins`` + ``schedulingProfiles``).
        replicas: the fleet, in pod order.
        block_size: the engines' block size (the index and scheduler use the same).
        seed: seeds the scheduler's random source.
        metrics_interval_s: staleness of the queue / KV-usage gauges the scorers see.
        gateways: router replicas in front of the fleet.

    Raises:
        ConfigError: ``gateways`` below 1.
    """

    def __init__(
        self,
        scheduler_config: Mapping[str, Any],
        replicas: Sequence[SimReplica],
        *,
        block_size: int,
        seed: int = 0,
        metrics_interval_s: float = 0.05,
        gateways: int = 1,
    ) -> None:
        if gateways < 1:
            raise ConfigError(f"gateways must be at least 1, got {gateways}")
        # Unbounded: the replicas report every eviction, so it never outgrows their caches.
        self.index = InMemoryIndex(capacity=None)
        self.applier = EventApplier(self.index, model=SIM_MODEL, block_size=block_size, algo=SIM_HASH_ALGO)
        self.schedulers = [
            Scheduler.from_config(
                scheduler_config,
                index=self.index,
                block_size=block_size,
                hash_algo=SIM_HASH_ALGO,
                rng=random.Random(seed if g == 0 else f"{seed}/gateway/{g}"),
            )
            for g in range(gateways)
        ]
        self._balancer = random.Random(f"{seed}/balancer")
        self.namespace = self.applier.namespace()
        self.block_size = block_size
        self.replicas = list(replicas)
        self._by_pod = {r.pod: r for r in self.replicas}
        self.metrics_interval_s = metrics_interval_s
        self._states = [
            [EndpointState(r.pod, kv_capacity_tokens=r.config.kv_capacity_tokens) for r in self.replicas]
            for _ in range(gateways)
        ]
        """Each gateway's view of the endpoints: shared scraped gauges, its own ``in_flight``."""
        self._ledgers = [prefill_ledger_of(scheduler_config) for _ in range(gateways)]
        """Each gateway's outstanding prefill work per endpoint and the speeds it learned."""
        self._awaiting_first_token: list[list[SimRequest]] = [[] for _ in range(gateways)]
        self._scraped_at = -1.0
        self.num_routed = 0
        self.num_unroutable = 0
        self.routed_by_gateway = [0] * gateways

    @property
    def scheduler(self) -> Scheduler:
        """The first gateway's scheduler (the only one when there is one gateway)."""
        return self.schedulers[0]

    def on_events(self, pod: PodId, events: list[KVEvent]) -> None:
        """Apply a replica's KV events to the index (the subscriber's job in a live router)."""
        apply = self.applier.apply
        for event in events:
            apply(pod, event)

    def _scrape(self, now: float) -> None:
        for i, replica in enumerate(self.replicas):
            waiting, running, usage = replica.num_waiting, replica.num_running, replica.kv_usage
            for states in self._states:
                state = states[i]
                state.waiting = waiting
                state.running = running
                state.kv_cache_usage = usage
        self._scraped_at = now

    def next_gateway(self) -> int:
        """The gateway the load balancer sends the next request to."""
        return 0 if len(self.schedulers) == 1 else self._balancer.randrange(len(self.schedulers))

    def admissible(
        self, req: SimRequest, gateway: int, now: float, detector: SaturationDetector
    ) -> list[EndpointState]:
        """The replicas flow control lets ``req`` go to in ``gateway``'s view (empty: saturated)."""
        if now - self._scraped_at >= self.metrics_interval_s:
            self._scrape(now)
        self._settle_first_tokens(gateway, now)
        scheduler = self.schedulers[gateway]
        # the estimate reads the prompt's length and its matched prefix only: no token list is built
        request = RoutingRequest(req.request_id, range(req.prompt_len), self.namespace)
        request.prefix = scheduler.match(request, req.keys)
        return detector.admissible(scheduler, request, self._states[gateway])

    def continues_cached_work(self, req: SimRequest, share: float) -> bool:
        """Whether ``share`` of ``req``'s prompt is cached somewhere, by the index (flow control's
        ``continuationShare``)."""
        if share <= 0 or not req.keys:
            return False
        request = RoutingRequest(req.request_id, range(req.prompt_len), self.namespace)
        return continues_cached_work(self.scheduler.match(request, req.keys), req.prompt_len, share)

    def route(
        self,
        req: SimRequest,
        now: float,
        gateway: int | None = None,
        endpoints: list[EndpointState] | None = None,
    ) -> SimReplica | None:
        """Pick the replica for ``req``; ``None`` if the scheduler finds no endpoint.

        Args:
            req: the request.
            now: virtual time.
            gateway: the router replica that routes it (``None``: the load balancer picks one).
            endpoints: the gateway's endpoint states to choose among (``None``: all of them).
        """
        if now - self._scraped_at >= self.metrics_interval_s:
            self._scrape(now)
        if gateway is None:
            gateway = self.next_gateway()
        scheduler, states = self.schedulers[gateway], self._states[gateway]
        self._settle_first_tokens(gateway, now)
        request = RoutingRequest(req.request_id, req.tokens, self.namespace)
        prefix = request.prefix = scheduler.match(request, req.keys)
        candidates = states if endpoints is None else endpoints
        if scheduler.pd is None:
            ranked = scheduler.rank(request, candidates)
            target = None if not ranked else ranked[0]
        else:
            decision = scheduler.pick(request, candidates)
            target = None if decision is None else decision.endpoint
        if target is None:
            self.num_unroutable += 1
            return None
        replica = self._by_pod[target]
        req.gateway = gateway
        state = states[replica.index]
        state.in_flight += 1
        hit = prefix.hit_tokens(target)
        uncached = (req.prompt_len or len(req.tokens)) - hit
        ledger = self._ledgers[gateway]
        ledger.sent(req.request_id, state, uncached, now, cached=hit)
        if ledger.sessions is not None:
            ledger.sessions.routed(request, state, now)
        self._awaiting_first_token[gateway].append(req)
        self.num_routed += 1
        self.routed_by_gateway[gateway] += 1
        return replica

    def _settle_first_tokens(self, gateway: int, now: float) -> None:
        """Hand the ledger the first tokens that arrived since the last decision (what a live
        router sees as each stream's first chunk)."""
        waiting = self._awaiting_first_token[gateway]
        ledger = self._ledgers[gateway]
        ledger.refresh(now)
        still: list[SimRequest] = []
        for req in waiting:
            if req.first_token >= 0:
                ledger.first_token(req.request_id, req.first_token)
            elif req.finish < 0 and req.failed is None:
                still.append(req)
            else:
                ledger.finished(req.request_id)
        self._awaiting_first_token[gateway] = still

    def done(self, req: SimRequest) -> None:
        """The router saw ``req``'s response end."""
        if req.replica >= 0:
            state = self._states[req.gateway][req.replica]
            state.in_flight -= 1
            if req.finish >= 0:
                ledger = self._ledgers[req.gateway]
                if req.first_token >= 0:  # not settled yet if no decision came since
                    ledger.first_token(req.request_id, req.first_token)
                ledger.released(req.request_id, state, req.prompt_len, req.finish)
