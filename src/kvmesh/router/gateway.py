# Over 450 lines: wiring, startup, shutdown and the per-request path share the components the gateway owns; parsing, proxying, admin, prewarm and the P/D leg are modules of their own.
"""The OpenAI-compatible gateway: the aiohttp app that wires parsing, scheduling and proxying.

Per request::

    body ─► RequestParser (validate, tenant, tokens once as u32) ─► RoutingRequest
         ─► Scheduler.match (remote index: on a worker thread)
         ─► FlowGate (every endpoint saturated: wait in the queue, or 429) ─► Scheduler.pick
         ─► [P/D: PrefillLeg] ─► UpstreamProxy: ranked[0], on connect failure ranked[1], ...
            ─► the answer streamed back chunk by chunk (SSE is never buffered)

The body is forwarded unchanged except where the router must add something: ``cache_salt`` when
the tenant came from ``x-tenant-id`` (so vLLM pods salt their blocks too) and
``kv_transfer_params`` on P/D legs. Responses carry ``x-kvmesh-endpoint`` naming the endpoint,
``x-request-id`` (the client's, or one the router assigns) and ``x-kvmesh-cache`` (cached and
prompt tokens, and why the rest missed: :mod:`kvmesh.router.cache_report`).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` and
``POST /v1/messages`` (:mod:`kvmesh.core.agent_apis`), ``GET /v1/models``,
``GET /health``, ``GET /metrics``, ``POST /v1/kvmesh/prewarm`` (:mod:`kvmesh.router.prewarm`) and
the admin API (:mod:`kvmesh.router.admin`). ``kvmesh router`` answers the four completion routes
on its own HTTP front (:meth:`Gateway.front_routes`, :mod:`kvmesh.router.front_server`) and the rest
on this app behind it; their handlers read the request through
:class:`~kvmesh.router.client_request.ClientRequest`, which both servers' requests satisfy.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import asdict, replace
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvmesh.core.agent_apis import PromptApi
from kvmesh.core.cache_usage import REQUEST_ID_HEADER
from kvmesh.core.hashing import HashAlgo
from kvmesh.core.tenancy import ENDPOINT_HEADER as ENDPOINT_HEADER
from kvmesh.core.tenancy import SESSION_HEADER, TENANT_HEADER
from kvmesh.core.types import PodId
from kvmesh.errors import ConfigError, RequestError, TierUnavailableError
from kvmesh.router.admin import AdminApi
from kvmesh.router.agent_routes import api_error, maybe_unserved_api
from kvmesh.router.cache_memory import RememberingIndex, prompt_texts
from kvmesh.router.cache_report import CacheReasonCollector, CacheReporter
from kvmesh.router.client_request import ClientRequest
from kvmesh.router.config import RouterConfig
from kvmesh.router.discovery import DnsDiscovery
from kvmesh.router.endpoints import (
    PROBE_CONNECTIONS_PER_ENDPOINT,
    Endpoint,
    EndpointConfig,
    EndpointPool,
    normalize_url,
)
from kvmesh.router.first_miss import tokenize_until_miss, whole_prompt_needed
from kvmesh.router.flow_control import TicketState
from kvmesh.router.flow_gate import QUEUE_WAIT_HEADER, FlowGate, parse_flow_headers, wait_ms
from kvmesh.router.front_http import HotHandler
from kvmesh.router.index import BlockIndex, InMemoryIndex, InstrumentedIndex
from kvmesh.router.ingest import EventApplier
from kvmesh.router.ingest_split import IngestSplit, SplitIngest
from kvmesh.router.intake import EventIntake
from kvmesh.router.keymemo import key_memo_for
from kvmesh.router.lora_state import merged_models, requested_adapter
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.pins import PinnedBlocks
from kvmesh.router.plugins.registry import prefill_ledger_of
from kvmesh.router.prefill_leg import PrefillLeg, decode_body
from kvmesh.router.prewarm import PrewarmApi
from kvmesh.router.proxy import UpstreamProxy
from kvmesh.router.redis_index import RedisIndex
from kvmesh.router.replies import error_response, json_response
from kvmesh.router.request_parser import ParsedRequest, RequestParser
from kvmesh.router.scheduler import Scheduler, load_scheduler_config
from kvmesh.router.tokenize import CachedTokenizer, PromptTokenizer
from kvmesh.router.types import Decision, EndpointState, PrefixMatch, RoutingRequest
from kvmesh.router.upstream_http import UpstreamClient
from kvmesh.router.usage import UsageCollector
from kvmesh.router.write_behind import WriteBehindIndex

logger = logging.getLogger(__name__)

UPSTREAM_CONNECT_TIMEOUT_S = 2.0
"""An endpoint that does not accept a connection this fast is skipped for the next ranked one."""

_FORWARD_HEADERS = ("authorization", TENANT_HEADER, SESSION_HEADER)
"""Client headers sent on to the endpoint (``x-request-id`` too, set by the router)."""


def forwarded_headers(request: ClientRequest) -> dict[str, str]:
    """The headers of ``request``'s call to an endpoint: the client's that are passed on (the last
    value of a repeated one) and the JSON content type."""
    headers: dict[str, str] = {}
    client = request.headers
    for name in _FORWARD_HEADERS:
        values = client.getall(name, None)
        if values:
            headers[name] = values[-1]
    headers["Content-Type"] = "application/json"
    return headers


class Gateway:
    """One router instance: pool, index, intake, scheduler and the aiohttp app around them.

    Args:
        config: the router configuration.
        tokenizer: text and chat tokenizer (``None``: text prompts are routed by load only);
            wrapped in a :class:`CachedTokenizer`.
        index: the block index (default from ``config.index``).
        ingest_split: this gateway's place among ``--workers`` that split event ingestion
            (:mod:`~kvmesh.router.ingest_split`; ``None``: it ingests every pod's events itself).

    Raises:
        ConfigError: ``ingest_split`` with an index other than the in-process one.
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        tokenizer: PromptTokenizer | None = None,
        index: BlockIndex | None = None,
        ingest_split: IngestSplit | None = None,
    ) -> None:
        self.config = config
        self.tokenizer: PromptTokenizer | None = (
            CachedTokenizer(
                tokenizer,
                cache_entries=config.tokenizer_cache_entries,
                prefix_reuse=config.tokenizer_prefix_reuse,
            )
            if tokenizer is not None and not isinstance(tokenizer, CachedTokenizer)
            else tokenizer
        )
        self.parser = RequestParser(
            self.tokenizer,
            tokenize_thread_min_chars=config.tokenize_thread_min_chars,
            max_pin_ttl_s=config.max_pin_ttl_s,
        )
        self.pinned = PinnedBlocks()
        """Block keys of prompts clients pinned: the in-memory index keeps them until expiry."""
        self.metrics = RouterMetrics()
        self.index_is_remote = config.index.backend == "redis" or (
            index is not None and not isinstance(index, InMemoryIndex)
        )
        """Whether index calls do network I/O (then matching runs on a worker thread)."""
        self._own_index = self._make_index() if index is None else None
        if ingest_split is not None and not isinstance(self._own_index, InMemoryIndex):
            raise ConfigError(
                "split event ingestion needs the in-process index (workers sharing a Redis/Valkey "
                "index already write it once)"
            )
        self.ingest_split = (
            None
            if ingest_split is None
            else ingest_split.placing(normalize_url(e.url) for e in config.endpoints)
        )
        self.split: SplitIngest | None = None
        """Writes to and from the other workers' indexes (``None``: ingestion not split)."""
        backend = index if index is not None else self._own_index
        assert backend is not None
        self.writer = WriteBehindIndex(backend) if self.index_is_remote else None
        """The remote index's background writer (``None`` for the in-process index)."""
        self.index: BlockIndex = InstrumentedIndex(
            self.writer if self.writer is not None else backend, self.metrics.registry
        )
        self.memo = key_memo_for(HashAlgo(config.hash_algo), config.index.key_memo_capacity)
        scheduler_config = (
            config.scheduler if config.scheduler is not None else load_scheduler_config(config.policy)
        )
        self.scheduler = Scheduler.from_config(
            scheduler_config,
            index=self.index,
            block_size=config.block_size,
            hash_algo=HashAlgo(config.hash_algo),
            rng=random.Random(config.seed),
            clock=time.perf_counter,
            on_timing=self.metrics.observe_scorer,
            memo=self.memo,
        )
        self._until_first_miss = not whole_prompt_needed(self.scheduler)
        """Long prompts may be tokenized until their first miss (no scorer needs whole prompts)."""
        self.cache_report = CacheReporter(
            config.cache_report, self.scheduler, self._engine_block_size, memo=self.memo
        )
        """Explains each answer's cache use (``x-kvmesh-cache``, ``/admin/explain``) and counts
        it per tenant (``/admin/usage``; a prewarm adds its tokens with
        ``cache_report.ledger.add_prewarmed``)."""
        report = self.cache_report
        self.metrics.registry.register(UsageCollector(report.ledger))
        self.metrics.registry.register(
            CacheReasonCollector(lambda: (report.requests_by_reason, report.missed_by_reason))
        )
        self.model: str | None = config.model
        self.revision: str | None = config.revision
        self.applier: EventApplier | None = None
        self.metrics.watch_ingest(lambda: self.applier)
        self.metrics.watch_endpoints(lambda: [] if self.pool is None else self.pool.states())
        self.metrics.watch_upstream(lambda: {} if self._client is None else self._client.connection_counts())
        self.intake: EventIntake | None = None
        self.pool: EndpointPool | None = None
        self.discovery: DnsDiscovery | None = None
        self.proxy: UpstreamProxy | None = None
        self.prefill_leg: PrefillLeg | None = None
        self._client: UpstreamClient | None = None
        """Requests to the endpoints, P/D prefill legs included (bounded per endpoint by ``config.upstream``)."""
        self._probe_session: aiohttp.ClientSession | None = None
        """The endpoint pool's health checks, scrapes and discovery, and ``/v1/models``."""
        self._pending_events: dict[PodId, tuple[str, str | None]] = {}
        self.prefill_ledger = prefill_ledger_of(scheduler_config)
        """Prefill work sent to each endpoint and not yet answered, and the pool's learned speed."""
        self.flow_gate = (
            FlowGate(config.flow_control, self.scheduler, self.prefill_ledger, self.metrics)
            if config.flow_control.enabled
            else None
        )
        """Holds requests while every endpoint is saturated (``None``: flow control off)."""
        self.app = self._build_app()

    def _make_index(self) -> RedisIndex | InMemoryIndex:
        cfg = self.config.index
        if cfg.backend == "redis":
            assert cfg.redis_url is not None, "RouterConfig validation lets redis through without a URL"
            return RedisIndex(
                cfg.redis_url,
                key_prefix=cfg.key_prefix,
                ttl_s=cfg.ttl_s,
                max_connections=cfg.redis_max_connections,
            )
        return InMemoryIndex(cfg.capacity, keep=self.pinned.holds)

    # ------------------------------------------------------------------ lifecycle

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post(PromptApi.RESPONSES.path, self._responses)
        app.router.add_post(PromptApi.MESSAGES.path, self._messages)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        AdminApi(
            self,
            token=self.config.admin_token,
            cache_report=self.cache_report,
            explain_history=self.config.cache_report.explain_history,
        ).register(app)
        PrewarmApi(self).register(app)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Open the client session, add the configured endpoints and start the background loops."""
        upstream = self.config.upstream
        client = self._client = UpstreamClient(
            max_connections_per_endpoint=upstream.max_connections_per_endpoint,
            keepalive_s=upstream.keepalive_s,
            connect_timeout_s=UPSTREAM_CONNECT_TIMEOUT_S,
        )
        # Probes get their own pool: behind requests waiting for a connection, a health check
        # would time out and take a busy (not dead) endpoint out of the pool.
        probes = self._probe_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=PROBE_CONNECTIONS_PER_ENDPOINT, ttl_dns_cache=300
            )
        )
        health = self.config.health
        pool = self.pool = EndpointPool(
            probes,
            health_interval=health.interval_s,
            health_timeout=health.timeout_s,
            failure_threshold=health.failure_threshold,
            metrics_interval=health.metrics_interval_s,
            on_events=self._on_events,
        )
        self.proxy = UpstreamProxy(
            client,
            pool,
            self.metrics,
            self.prefill_ledger,
            request_timeout_s=self.config.request_timeout_s,
            max_attempts=self.config.max_attempts,
            on_first_token=None if self.flow_gate is None else self.flow_gate.wake,
            reporter=self.cache_report,
        )
        self.prefill_leg = PrefillLeg(client, pool, self.metrics, timeout_s=self.config.request_timeout_s)
        for endpoint in self.config.endpoints:
            await pool.add(endpoint)
        if self.config.discovery:
            self.discovery = DnsDiscovery(pool, self.config.discovery)
            await self.discovery.refresh()
            self.discovery.start()
        if self.writer is not None:
            self.writer.start()
        self.maybe_start_intake()
        pool.start()
        if self.flow_gate is not None:
            self.flow_gate.start(pool.states)

    async def aclose(self) -> None:
        """Stop background work and close sockets and sessions."""
        if self.flow_gate is not None:
            await self.flow_gate.aclose()
        if self.discovery is not None:
            await self.discovery.aclose()
        if self.pool is not None:
            await self.pool.aclose()
        if self.intake is not None:
            await self.intake.aclose()
        if self.split is not None:
            await self.split.aclose()
        if self.writer is not None:
            await asyncio.to_thread(self.writer.close)
        if isinstance(self._own_index, RedisIndex):
            self._own_index.close()
        if self._client is not None:
            await self._client.aclose()
        if self._probe_session is not None:
            await self._probe_session.close()
        self._client = self._probe_session = None

    def _on_events(self, pod: PodId, endpoint: str | None, replay: str | None) -> None:
        if endpoint is None:
            self._pending_events.pop(pod, None)
            if self.intake is not None:
                self.intake.remove_pod(pod)
            return
        if self.intake is None:
            self._pending_events[pod] = (endpoint, replay)
            self.maybe_start_intake()
        else:
            self._subscribe(pod, endpoint, replay)

    def _subscribe(self, pod: PodId, endpoint: str, replay: str | None) -> None:
        """Take ``pod``'s events, unless another worker of a split ingests them."""
        assert self.intake is not None
        if self.split is not None:
            if not self.split.split.owns(pod):
                return
            if self.intake.sources.get(pod) != (endpoint, replay):
                self.split.pod_added(pod)
        self.intake.add_pod(pod, endpoint, replay)

    def maybe_start_intake(self) -> None:
        """Create the applier once the namespace model is known (from config or the first engine)."""
        if self.intake is not None:
            return
        if self.model is None and self.pool is not None:
            for e in self.pool.endpoints:
                if e.info is not None and e.info.model:
                    self.model = e.info.model
                    if self.revision is None:
                        self.revision = e.info.revision
                    break
        if self.model is None:
            return
        seen = self.cache_report.seen
        local: BlockIndex = RememberingIndex(self.index, seen) if seen.capacity else self.index
        if self.ingest_split is not None:
            assert isinstance(self._own_index, InMemoryIndex)
            self.split = SplitIngest(
                self.ingest_split,
                local,
                held=self._own_index.held_by,
                owned_pods=lambda: self.intake.sources if self.intake is not None else (),
                block_sizes=lambda: self.applier.pod_block_sizes() if self.applier is not None else {},
                on_block_size=lambda pod, size: (
                    self.applier.note_peer_block_size(pod, size) if self.applier is not None else None
                ),
            )
            local = self.split
        self.applier = EventApplier(
            local,
            model=self.model,
            revision=self.revision or "",
            block_size=self.config.block_size,
            algo=HashAlgo(self.config.hash_algo),
            max_blocks_per_pod=self.config.index.max_blocks_per_pod,
            memo=self.memo,
        )
        self.scheduler.align_match = self.applier.align_match
        self.intake = EventIntake(
            self.applier, topic=self.config.events_topic, on_lag=self.metrics.event_lag_seconds.observe
        )
        for pod, (endpoint, replay) in self._pending_events.items():
            self._subscribe(pod, endpoint, replay)
        self._pending_events.clear()
        self.intake.start()
        if self.split is not None:
            self.split.start()

    # ------------------------------------------------------------------ what the admin API sees

    def endpoints(self) -> list[Endpoint]:
        """The pool's endpoints (none before :meth:`start`)."""
        return [] if self.pool is None else list(self.pool.endpoints)

    async def add_endpoint(self, config: EndpointConfig) -> Endpoint:
        """Add (or replace) an endpoint at run time; its model may let event intake start.

        Raises:
            ConfigError: the endpoint's config is unusable.
        """
        assert self.pool is not None, "endpoints are added after Gateway.start()"
        endpoint = await self.pool.add(config)
        self.maybe_start_intake()
        return endpoint

    def remove_endpoint(self, pod: PodId) -> bool:
        """Remove an endpoint; ``False`` when it was not in the pool."""
        return self.pool is not None and self.pool.remove(pod)

    async def index_report(self) -> dict[str, Any]:
        """Statistics of the index, the event applier and subscriber, and the prompt tokenizer."""
        index = self.index
        stats = await asyncio.to_thread(index.stats) if self.index_is_remote else index.stats()
        body: dict[str, Any] = {"index": asdict(stats)}
        applier = self.applier
        if applier is not None:
            body.update(
                ingest=asdict(applier.stats),
                model=applier.model,
                block_size=applier.block_size,
                pods=applier.pod_stats(),
            )
        if self.intake is not None:
            body["subscriber"] = asdict(self.intake.subscriber.stats)
        if self.split is not None:
            body["ingest_split"] = {
                "worker": self.split.split.worker,
                "workers": self.split.split.num_workers,
                "pods": sorted(self.intake.sources) if self.intake is not None else [],
                **asdict(self.split.link_stats),
            }
        if isinstance(self.tokenizer, CachedTokenizer):
            body["tokenizer"] = self.tokenizer.stats()
        return body

    # ------------------------------------------------------------------ OpenAI routes

    def front_routes(self) -> dict[str, HotHandler]:
        """The ``POST`` routes the router's front serves itself (:mod:`kvmesh.router.front_server`)."""
        return {
            "/v1/completions": self._completions,
            "/v1/chat/completions": self._chat,
            PromptApi.RESPONSES.path: self._responses,
            PromptApi.MESSAGES.path: self._messages,
        }

    async def _completions(self, request: ClientRequest) -> web.StreamResponse:
        return await self._route(request, chat=False, path=PromptApi.COMPLETIONS.path)

    async def _chat(self, request: ClientRequest) -> web.StreamResponse:
        return await self._route(request, chat=True, path=PromptApi.CHAT.path)

    async def _responses(self, request: ClientRequest) -> web.StreamResponse:
        return await self.handle(request, PromptApi.RESPONSES)

    async def _messages(self, request: ClientRequest) -> web.StreamResponse:
        return await self.handle(request, PromptApi.MESSAGES)

    async def handle(self, request: ClientRequest, api: PromptApi) -> web.StreamResponse:
        """Route one request of ``api`` (the entry point a pooled router dispatches to)."""
        response = await self._route(request, chat=api.is_chat, api=api, path=api.path)
        return maybe_unserved_api(api, response, response.headers.get(ENDPOINT_HEADER))

    async def _route(
        self, request: ClientRequest, *, chat: bool, path: str, api: PromptApi | None = None
    ) -> web.StreamResponse:
        """Parse, route and forward ``request`` to the endpoints' ``path`` (the route's own, also
        when the client reached it under a pool's ``/pools/<name>`` prefix)."""
        started = time.perf_counter()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return api_error(api, 413, f"request body larger than {self.config.max_body_bytes} bytes")
        try:
            parsed = await self.parser.parse(
                raw,
                request.headers,
                chat=chat,
                model=self.model,
                revision=self.revision,
                api=api,
                until_first_miss=self._until_first_miss,
            )
        except RequestError as exc:
            self.metrics.errors.labels("bad_request").inc()
            return api_error(api, exc.status, exc.message, param=exc.param)
        response = await self._send(request, parsed, chat=chat, path=path, started=started)
        if parsed.pin_ttl_s is not None and response.status == 200:
            # Keep a pinned prompt's blocks in the index once an engine accepted the request.
            routing = parsed.routing
            self.pinned.pin(
                self.scheduler.hasher(routing.namespace).hash_blocks(routing.tokens), parsed.pin_ttl_s
            )
        return response

    async def _send(
        self, request: ClientRequest, parsed: ParsedRequest, *, chat: bool, path: str, started: float
    ) -> web.StreamResponse:
        """Match, admit, pick and forward a parsed request."""
        routing = parsed.routing
        if self.pool is not None and (
            adapter := requested_adapter(
                parsed.body.get("model"), routing.namespace.model, self.pool.states()
            )
        ):
            routing.namespace = replace(routing.namespace, lora=adapter)
        if parsed.long_prompt is not None:
            routing.prefix = await tokenize_until_miss(
                parsed.long_prompt, routing, self.scheduler, off_loop=self.index_is_remote
            )
        elif self.index_is_remote:
            routing.prefix = await self._match_off_loop(routing)
        pool, proxy, prefill_leg = self.pool, self.proxy, self.prefill_leg
        assert pool is not None and proxy is not None and prefill_leg is not None, (
            "requests arrived before Gateway.start()"
        )
        gate = self.flow_gate
        if gate is None:
            decision = self._pick(routing, pool.states())
            self.metrics.schedule_seconds.observe(time.perf_counter() - started)
            extra = None
        else:
            try:
                priority, max_wait_s = parse_flow_headers(request.headers)
            except RequestError as exc:
                self.metrics.errors.labels("bad_request").inc()
                return error_response(exc.status, exc.message, param=exc.param)
            ticket = await gate.admit(
                routing, tenant=parsed.tenant, priority=priority, max_wait_s=max_wait_s, request=request
            )
            if ticket.state is TicketState.SHED:
                return gate.shed_response(ticket)
            if ticket.state is TicketState.REMOVED:
                if gate.closed:
                    return error_response(503, "the router is shutting down", kind="service_unavailable")
                return web.Response(status=499)  # the client went away while queued: nobody reads this
            try:
                if ticket.state is TicketState.DISPATCHED:
                    # the index moved on while the request waited: match it again
                    if parsed.long_prompt is not None:  # its first miss may have moved too
                        routing.prefix = await tokenize_until_miss(
                            parsed.long_prompt, routing, self.scheduler, off_loop=self.index_is_remote
                        )
                    else:
                        routing.prefix = await self._match_off_loop(routing) if self.index_is_remote else None
                decision = self._pick(routing, gate.endpoints_for(ticket, pool.states()))
            finally:
                gate.release(ticket)
            self.metrics.schedule_seconds.observe(time.perf_counter() - started - ticket.waited_s)
            extra = {QUEUE_WAIT_HEADER: wait_ms(ticket)}
        if decision is None:
            self.metrics.errors.labels("no_endpoint").inc()
            return error_response(
                503, "no healthy endpoint can serve this request", kind="service_unavailable"
            )
        headers = forwarded_headers(request)
        request_id = self.cache_report.request_id(request.headers.get(REQUEST_ID_HEADER))
        headers[REQUEST_ID_HEADER] = request_id
        note = self.cache_report.begin(
            request_id, parsed.tenant, routing, decision, prompt_texts(parsed.body, chat=chat)
        )
        raw = parsed.raw
        if decision.prefill is not None:
            await prefill_leg.run(path, parsed.body, headers, decision.prefill)
            raw = msgspec.json.encode(decode_body(parsed.body))
        self.metrics.prompt_tokens.inc(routing.num_tokens)
        if gate is None:
            return await proxy.forward(request, raw, headers, decision, routing, note=note, path=path)
        try:
            return await proxy.forward(request, raw, headers, decision, routing, extra, note=note, path=path)
        finally:
            gate.wake()

    def _engine_block_size(self, pod: PodId) -> int | None:
        """``pod``'s engine block size: from its KV events, else its ``/kvmesh/info``."""
        size = None if self.applier is None else self.applier.pod_block_size(pod)
        if size is None and self.pool is not None:
            endpoint = self.pool.get(pod)
            if endpoint is not None and endpoint.info is not None:
                size = endpoint.info.block_size
        return size

    def _pick(self, routing: RoutingRequest, endpoints: list[EndpointState]) -> Decision | None:
        """The scheduler's decision among ``endpoints``; by load alone when the remote index cannot
        be reached."""
        self.prefill_ledger.refresh(time.perf_counter())
        try:
            return self.scheduler.pick(routing, endpoints)
        except TierUnavailableError as exc:
            logger.warning("index unavailable, routing by load: %s", exc)
            routing.prefix = PrefixMatch(0, self.config.block_size)
            return self.scheduler.pick(routing, endpoints)

    async def _match_off_loop(self, routing: RoutingRequest) -> PrefixMatch:
        """:meth:`Scheduler.match` on a worker thread, for an index that does network I/O."""
        try:
            return await asyncio.to_thread(self.scheduler.match, routing)
        except TierUnavailableError as exc:
            logger.warning("index unavailable, routing by load: %s", exc)
            return PrefixMatch(0, self.config.block_size)

    async def _models(self, request: web.Request) -> web.Response:
        assert self._probe_session is not None and self.pool is not None
        # Endpoints serving LoRA adapters each list their own; the router lists them all.
        listed = merged_models(e.models for e in self.pool.endpoints if e.state.healthy and e.models)
        if listed:
            return json_response({"object": "list", "data": listed})
        for state in self.pool.states():
            if not state.healthy:
                continue
            try:
                async with self._probe_session.get(
                    f"{state.pod}/v1/models", timeout=aiohttp.ClientTimeout(total=2.0)
                ) as resp:
                    if resp.status == 200:
                        return web.Response(body=await resp.read(), content_type="application/json")
            except (aiohttp.ClientError, TimeoutError):
                continue
        if self.model is None:
            return error_response(
                503, "no healthy endpoint and no configured model", kind="service_unavailable"
            )
        return json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "kvmesh"}]}
        )

    async def _health(self, request: web.Request) -> web.Response:
        states = self.pool.states() if self.pool is not None else []
        healthy = sum(1 for s in states if s.healthy)
        body = {
            "status": "ok" if healthy else "no healthy endpoint",
            "endpoints": len(states),
            "healthy": healthy,
        }
        return json_response(body, status=200 if healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(self.metrics.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp
