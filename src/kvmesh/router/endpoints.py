"""The endpoint pool: discovery, health checks, load metrics and in-flight counts.

Each endpoint is an engine's base URL. On add, ``GET /kvmesh/info`` discovers its events endpoint,
role and model (unmodified vLLM pods answer 404; their event endpoints come from config). Two
background loops then run per pool:

* health: ``GET /health`` every ``health_interval`` s with ``health_timeout``; after
  ``failure_threshold`` consecutive failures the endpoint leaves the pool (``healthy = False``), and
  one success brings it back. The gateway also reports connect failures, which count at once.
  With the defaults (0.5 s, 0.5 s, 2) a dead endpoint leaves within about 1.5 s while requests
  flow. While the router sends nothing and every endpoint is well, the interval doubles each round
  up to 16× (8 s at most; :mod:`~kvmesh.router.idle_backoff`) and the next request restores it.
* load: ``GET /metrics`` every ``metrics_interval`` s (stretched alike while no endpoint has work), reading vLLM's gauges
  ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc``
  (``vllm:gpu_cache_usage_perc`` on older vLLM), summed over label sets, and LoRA adapters
  (``vllm:lora_requests_info``; see :mod:`kvmesh.router.lora_state`). An endpoint that reports
  adapters has its ``GET /v1/models`` read when it runs one not listed yet, and every
  ``MODELS_REFRESH_S`` s, for the adapters it can serve. A vLLM endpoint's KV capacity comes from
  ``vllm:cache_config_info`` (:mod:`kvmesh.router.cache_config`) unless ``/kvmesh/info`` gave one.

The pool mutates endpoint state only on the event loop; :meth:`EndpointPool.states` hands the
scheduler the live records without copying.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from kvmesh.core.tasks import cancel_and_wait
from kvmesh.core.tenancy import Role
from kvmesh.core.types import PodId
from kvmesh.errors import ConfigError
from kvmesh.router.cache_config import CacheConfigWatch
from kvmesh.router.exposition import gauge_totals
from kvmesh.router.idle_backoff import IdleBackoff
from kvmesh.router.lora_state import LoraState, adapters_of_models, parse_lora_info
from kvmesh.router.types import EndpointState

logger = logging.getLogger(__name__)

PROBE_CONNECTIONS_PER_ENDPOINT = 4
"""Connections the pool's session keeps to one endpoint. At most three requests are ever open to
an endpoint at once (a health check, a scrape, and discovery when an endpoint is added or comes
back), since timeouts close the connection of a request that hangs."""

_WAITING = ("vllm:num_requests_waiting",)
_RUNNING = ("vllm:num_requests_running",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_GAUGES = (*_WAITING, *_RUNNING, *_KV_USAGE)

MODELS_REFRESH_S = 30.0
"""Seconds between ``/v1/models`` reads of an endpoint that serves LoRA adapters (adapters can be
loaded and unloaded at run time)."""


class EndpointConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """One endpoint as configured (YAML ``endpoints:`` entries, admin API bodies).

    Attributes:
        url: base URL, e.g. ``http://10.0.0.5:8000``; also the pod id.
        role: ``both``, ``prefill`` or ``decode``; ``None`` takes the engine's own.
        events_endpoint: ZMQ PUB address of its KV events; ``None`` discovers it.
        replay_endpoint: ZMQ ROUTER address for replay; ``None`` discovers it.
    """

    url: str
    role: str | None = None
    events_endpoint: str | None = None
    replay_endpoint: str | None = None


class EngineInfo(msgspec.Struct):
    """``GET /kvmesh/info`` of a kvmesh engine (fields may grow; unknown ones are ignored)."""

    model: str = ""
    block_size: int = 16
    hash_algo: str = "sha256"
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    role: str = "both"
    kv_bytes_per_token: int = 0
    kv_capacity_tokens: int = 0
    max_model_len: int = 0
    revision: str = ""


@dataclass(slots=True)
class Endpoint:
    """An endpoint's configuration, discovered facts and live state."""

    config: EndpointConfig
    state: EndpointState
    info: EngineInfo | None = None
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    consecutive_failures: int = 0
    last_error: str = ""
    models: list[dict[str, Any]] = field(default_factory=list)
    """The ``data`` entries of its last ``/v1/models`` answer (read only for LoRA endpoints)."""
    models_read_at: float = -math.inf
    cache_config: CacheConfigWatch | None = None
    """Its KV capacity from ``vllm:cache_config_info`` (made at the first scrape)."""


def normalize_url(url: str) -> PodId:
    """The pod id of a base URL: scheme://host:port without a trailing slash.

    Raises:
        ConfigError: not an http(s) URL with a host.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"endpoint URL must look like http://host:port, got {url!r}")
    return PodId(f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}")


def _reachable(zmq_endpoint: str | None, url: PodId) -> str | None:
    """Replace a wildcard bind host in ``zmq_endpoint`` with the endpoint's HTTP host."""
    if not zmq_endpoint:
        return None
    if not zmq_endpoint.startswith("tcp://"):
        return zmq_endpoint
    hostport = zmq_endpoint[len("tcp://") :]
    host, _, port = hostport.rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::", ""):
        return f"tcp://{urlsplit(url).hostname}:{port}"
    return zmq_endpoint


class EndpointPool:
    """The set of endpoints and their live state.

    Args:
        session: HTTP client session used for discovery, health and metrics, kept apart from the
            requests' (whose connections may all be busy); :data:`PROBE_CONNECTIONS_PER_ENDPOINT`
            per endpoint is enough for it.
        health_interval: seconds between health checks.
        health_timeout: seconds before a health check counts as failed.
        failure_threshold: consecutive failures that take an endpoint out.
        metrics_interval: seconds between ``/metrics`` scrapes (0 disables scraping).
        on_events: called with (pod, events endpoint, replay endpoint) when an endpoint's event
            stream becomes known; with (pod, None, None) when the endpoint is removed.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        health_interval: float = 0.5,
        health_timeout: float = 0.5,
        failure_threshold: int = 2,
        metrics_interval: float = 1.0,
        on_events: Callable[[PodId, str | None, str | None], None] | None = None,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.session = session
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.failure_threshold = failure_threshold
        self.metrics_interval = metrics_interval
        self.on_events = on_events
        self._health_wait = IdleBackoff(health_interval)
        self._metrics_wait = IdleBackoff(max(metrics_interval, 0.0))
        self._endpoints: dict[PodId, Endpoint] = {}
        self._states: list[EndpointState] = []
        self._tasks: list[asyncio.Task[None]] = []

    def __contains__(self, pod: object) -> bool:
        return pod in self._endpoints

    def get(self, pod: PodId) -> Endpoint | None:
        """The endpoint with this pod id, if any."""
        return self._endpoints.get(pod)

    @property
    def endpoints(self) -> list[Endpoint]:
        """Every endpoint, healthy or not."""
        return list(self._endpoints.values())

    def states(self) -> list[EndpointState]:
        """Live scheduler records of every endpoint (do not mutate)."""
        return self._states

    async def add(self, config: EndpointConfig) -> Endpoint:
        """Add (or replace) an endpoint, discovering what its config leaves open.

        The endpoint starts healthy when discovery or a health check answers, unhealthy otherwise
        (health checks bring it in later).

        Raises:
            ConfigError: the URL or role is invalid.
        """
        pod = normalize_url(config.url)
        try:
            role = Role.parse(config.role) if config.role else None
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        info, reachable = await self._discover(pod)
        if role is None:
            role = (
                Role.parse(info.role)
                if info is not None and info.role in ("both", "prefill", "decode")
                else Role.BOTH
            )
        if not reachable:
            reachable = await self._check_once(pod)
        state = EndpointState(pod=pod, role=role, healthy=reachable)
        if info is not None:
            state.kv_bytes_per_token = info.kv_bytes_per_token
            state.kv_capacity_tokens = info.kv_capacity_tokens
        endpoint = Endpoint(config=config, state=state, info=info)
        endpoint.events_endpoint = config.events_endpoint or (
            _reachable(info.events_endpoint, pod) if info is not None else None
        )
        endpoint.replay_endpoint = config.replay_endpoint or (
            _reachable(info.replay_endpoint, pod) if info is not None else None
        )
        if pod in self._endpoints:
            self._detach(pod)
        self._endpoints[pod] = endpoint
        self._states.append(state)
        if endpoint.events_endpoint and self.on_events is not None:
            self.on_events(pod, endpoint.events_endpoint, endpoint.replay_endpoint)
        return endpoint

    def remove(self, pod: PodId) -> bool:
        """Remove an endpoint. Returns ``False`` when it was not in the pool."""
        if pod not in self._endpoints:
            return False
        self._detach(pod)
        if self.on_events is not None:
            self.on_events(pod, None, None)
        return True

    def _detach(self, pod: PodId) -> None:
        endpoint = self._endpoints.pop(pod)
        self._states = [s for s in self._states if s is not endpoint.state]

    def begin_request(self, pod: PodId) -> None:
        """Count a request sent to ``pod``."""
        endpoint = self._endpoints.get(pod)
        if endpoint is not None:
            endpoint.state.in_flight += 1
        self._health_wait.note_activity()
        self._metrics_wait.note_activity()

    def end_request(self, pod: PodId) -> None:
        """Count a request to ``pod`` as finished (successfully or not)."""
        endpoint = self._endpoints.get(pod)
        if endpoint is not None and endpoint.state.in_flight > 0:
            endpoint.state.in_flight -= 1

    def report_failure(self, pod: PodId, reason: str) -> None:
        """A request could not connect to ``pod``: take it out until a health check passes."""
        endpoint = self._endpoints.get(pod)
        if endpoint is None:
            return
        endpoint.consecutive_failures = max(endpoint.consecutive_failures, self.failure_threshold)
        endpoint.last_error = reason
        if endpoint.state.healthy:
            logger.warning("endpoint %s out of the pool: %s", pod, reason)
        endpoint.state.healthy = False

    def start(self) -> None:
        """Start the health and metrics loops on the running loop."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._health_loop()))
        if self.metrics_interval > 0:
            self._tasks.append(loop.create_task(self._metrics_loop()))

    async def aclose(self) -> None:
        """Stop the background loops."""
        await cancel_and_wait(self._tasks)
        self._tasks.clear()

    async def _discover(self, pod: PodId) -> tuple[EngineInfo | None, bool]:
        """(info or None, whether the endpoint answered at all)."""
        timeout = aiohttp.ClientTimeout(total=max(self.health_timeout, 2.0))
        try:
            async with self.session.get(f"{pod}/kvmesh/info", timeout=timeout) as resp:
                body = await resp.read()
                if resp.status != 200:
                    return None, True
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.info("endpoint %s not reachable for discovery: %s", pod, exc)
            return None, False
        try:
            return msgspec.json.decode(body, type=EngineInfo), True
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("endpoint %s sent an unreadable /kvmesh/info: %s", pod, exc)
            return None, True

    async def _check_once(self, pod: PodId) -> bool:
        timeout = aiohttp.ClientTimeout(total=self.health_timeout)
        try:
            async with self.session.get(f"{pod}/health", timeout=timeout) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _check(self, endpoint: Endpoint) -> None:
        ok = await self._check_once(endpoint.state.pod)
        if ok:
            if not endpoint.state.healthy:
                logger.info("endpoint %s back in the pool", endpoint.state.pod)
                await self._rediscover(endpoint)
            endpoint.consecutive_failures = 0
            endpoint.state.healthy = True
            return
        endpoint.consecutive_failures += 1
        if endpoint.consecutive_failures >= self.failure_threshold and endpoint.state.healthy:
            logger.warning("endpoint %s out of the pool: health check failed", endpoint.state.pod)
            endpoint.last_error = "health check failed"
            endpoint.state.healthy = False

    async def _rediscover(self, endpoint: Endpoint) -> None:
        """An endpoint came back: it may be a new process with new event sockets (or its first start)."""
        pod = endpoint.state.pod
        if endpoint.config.events_endpoint or self._endpoints.get(pod) is not endpoint:
            return
        info, _ = await self._discover(pod)
        if info is None:
            return
        endpoint.info = info
        endpoint.state.kv_bytes_per_token = info.kv_bytes_per_token
        if info.kv_capacity_tokens > 0:
            endpoint.state.kv_capacity_tokens = info.kv_capacity_tokens
        if endpoint.config.role is None and info.role in ("both", "prefill", "decode"):
            endpoint.state.role = Role.parse(info.role)
        events = _reachable(info.events_endpoint, pod)
        replay = endpoint.config.replay_endpoint or _reachable(info.replay_endpoint, pod)
        if (events, replay) == (endpoint.events_endpoint, endpoint.replay_endpoint):
            return
        endpoint.events_endpoint, endpoint.replay_endpoint = events, replay
        if events and self.on_events is not None:
            self.on_events(pod, events, replay)

    async def _health_loop(self) -> None:
        while True:
            endpoints = list(self._endpoints.values())
            if endpoints:
                await asyncio.gather(*(self._check(e) for e in endpoints))
            busy = any(not e.state.healthy or e.consecutive_failures or e.state.in_flight for e in endpoints)
            await self._health_wait.wait(busy=busy)

    async def _scrape(self, endpoint: Endpoint) -> None:
        if not endpoint.state.healthy:
            return
        timeout = aiohttp.ClientTimeout(total=max(self.health_timeout, 1.0))
        try:
            async with self.session.get(f"{endpoint.state.pod}/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return
        gauges = gauge_totals(text, _GAUGES)
        state = endpoint.state
        for name in _WAITING:
            if name in gauges:
                state.waiting = max(int(gauges[name]), 0)
        for name in _RUNNING:
            if name in gauges:
                state.running = max(int(gauges[name]), 0)
        for name in _KV_USAGE:
            if name in gauges:
                state.kv_cache_usage = min(max(gauges[name], 0.0), 1.0)
                break
        if endpoint.info is None or endpoint.info.kv_capacity_tokens <= 0:
            if endpoint.cache_config is None:
                endpoint.cache_config = CacheConfigWatch(state.pod)
            state.kv_capacity_tokens = endpoint.cache_config.read(text)
        lora = parse_lora_info(text)
        if lora is not None:
            await self._update_lora(endpoint, lora)
        elif state.lora is not None:  # restarted without LoRA
            state.lora = None
            endpoint.models = []

    async def _update_lora(self, endpoint: Endpoint, lora: LoraState) -> None:
        """Record the endpoint's running adapters, reading ``/v1/models`` for the servable ones
        when it runs one not listed or the list is old."""
        previous = endpoint.state.lora
        servable = frozenset() if previous is None else previous.servable
        now = time.monotonic()
        if not lora.active <= servable or now - endpoint.models_read_at >= MODELS_REFRESH_S:
            endpoint.models_read_at = now
            timeout = aiohttp.ClientTimeout(total=max(self.health_timeout, 1.0))
            try:
                async with self.session.get(f"{endpoint.state.pod}/v1/models", timeout=timeout) as resp:
                    document = await resp.json(content_type=None) if resp.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError):
                document = None
            if document is not None:
                servable = adapters_of_models(document)
                data = document.get("data") if isinstance(document, dict) else None
                endpoint.models = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        lora.servable = servable
        endpoint.state.lora = lora

    async def _metrics_loop(self) -> None:
        while True:
            endpoints = list(self._endpoints.values())
            if endpoints:
                await asyncio.gather(*(self._scrape(e) for e in endpoints))
            busy = any(e.state.in_flight or e.state.waiting or e.state.running for e in endpoints)
            await self._metrics_wait.wait(busy=busy)
