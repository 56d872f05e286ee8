"""The OpenAI-compatible gateway: parse, tokenize, pick an endpoint, proxy.

Per request::

    body ─► validate ─► tokens (prompt ids as given, text through the tokenizer, chat through
            the chat template) ─► RoutingRequest(namespace = model + tenant) ─► Scheduler.pick
         ─► [P/D: prefill leg] ─► forward to ranked[0]; on connect failure mark it down and try
            ranked[1], ... ─► stream the answer back chunk by chunk (SSE is never buffered)

The body is forwarded unchanged except where the router must add something: ``cache_salt`` when
the tenant came from ``x-tenant-id`` (so vLLM pods salt their blocks too) and
``kv_transfer_params`` on P/D legs. Responses carry ``x-kvmesh-endpoint`` naming the endpoint.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` and, behind a bearer token, ``/admin/endpoints`` (GET, POST,
DELETE), ``POST /admin/flush`` and ``GET /admin/index``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from yarl import URL

from kvmesh.core.hashing import HashAlgo, Namespace
from kvmesh.core.types import PodId
from kvmesh.errors import ConfigError, RequestError, TierUnavailableError
from kvmesh.router.config import RouterConfig
from kvmesh.router.discovery import DnsDiscovery
from kvmesh.router.endpoints import EndpointConfig, EndpointPool, normalize_url
from kvmesh.router.index import BlockIndex, InMemoryIndex, InstrumentedIndex
from kvmesh.router.ingest import EventApplier
from kvmesh.router.intake import EventIntake
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.prefill_ledger import PrefillLedger
from kvmesh.router.prefix import as_token_array
from kvmesh.router.scheduler import Scheduler, load_scheduler_config
from kvmesh.router.tokenize import CachedTokenizer, PromptTokenizer
from kvmesh.router.types import Decision, PrefixMatch, RoutingRequest

logger = logging.getLogger(__name__)

ENDPOINT_HEADER = "x-kvmesh-endpoint"
TENANT_HEADER = "x-tenant-id"
SESSION_HEADER = "x-session-id"
_USAGE_TAIL = 16 * 1024
_FORWARD_HEADERS = ("authorization", "x-request-id", TENANT_HEADER, SESSION_HEADER)


def _error(
    status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error"
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json")


def _is_token_list(value: list[Any]) -> bool:
    """Every element an int (not a bool) in [0, 2^32), checked at C speed."""
    try:
        as_token_array(msgspec.convert(value, list[int]))
    except (msgspec.ValidationError, ValueError):
        return False
    return True


class Gateway:
    """One router instance: pool, index, intake, scheduler and the aiohttp app around them.

    Args:
        config: the router configuration.
        tokenizer: text and chat tokenizer (``None``: text prompts are routed by load only);
            wrapped in a :class:`CachedTokenizer`.
        index: the block index (default from ``config.index``).
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        tokenizer: PromptTokenizer | None = None,
        index: BlockIndex | None = None,
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
        self.metrics = RouterMetrics()
        self.index: BlockIndex = InstrumentedIndex(
            index if index is not None else self._make_index(), self.metrics.registry
        )
        self._index_is_remote = config.index.backend == "redis" or (
            index is not None and not isinstance(index, InMemoryIndex)
        )
        memo_capacity = config.index.key_memo_capacity
        self.memo = BlockKeyMemo(memo_capacity) if memo_capacity > 0 else None
        scheduler_config = (
            config.scheduler if config.scheduler is not None else load_scheduler_config(config.policy)
        )
        self.scheduler = Scheduler.from_config(
            scheduler_config,
            index=None if self._index_is_remote else self.index,
            block_size=config.block_size,
            hash_algo=HashAlgo(config.hash_algo),
            rng=random.Random(config.seed),
            clock=time.perf_counter,
            on_timing=self.metrics.observe_scorer,
            memo=self.memo,
        )
        self.model: str | None = config.model
        self.revision: str | None = config.revision
        self.applier: EventApplier | None = None
        self.metrics.watch_ingest(lambda: self.applier)
        self.metrics.watch_endpoints(lambda: [] if self.pool is None else self.pool.states())
        self.intake: EventIntake | None = None
        self.pool: EndpointPool | None = None
        self.discovery: DnsDiscovery | None = None
        self._session: aiohttp.ClientSession | None = None
        self._pending_events: dict[PodId, tuple[str, str | None]] = {}
        self._ids = itertools.count()
        self.prefill_ledger = PrefillLedger()
        """Prefill work sent to each endpoint and not yet answered, and the pool's learned speed."""
        self._request_timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=2.0)
        self._urls: dict[tuple[PodId, str], URL] = {}
        self.app = self._build_app()

    def _upstream_url(self, pod: PodId, path: str) -> URL:
        """Parsed once per (endpoint, route): URL parsing is a visible share of a proxied request."""
        url = self._urls.get((pod, path))
        if url is None:
            url = self._urls[(pod, path)] = URL(f"{pod}{path}")
        return url

    def _make_index(self) -> BlockIndex:
        cfg = self.config.index
        if cfg.backend == "redis":
            from kvmesh.router.redis_index import RedisIndex

            assert cfg.redis_url is not None, "RouterConfig validation lets redis through without a URL"
            return RedisIndex(cfg.redis_url, key_prefix=cfg.key_prefix, ttl_s=cfg.ttl_s)
        return InMemoryIndex(cfg.capacity)

    # ------------------------------------------------------------------ lifecycle

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/admin/endpoints", self._admin(self._list_endpoints))
        app.router.add_post("/admin/endpoints", self._admin(self._add_endpoint))
        app.router.add_delete("/admin/endpoints", self._admin(self._remove_endpoint))
        app.router.add_post("/admin/flush", self._admin(self._flush))
        app.router.add_get("/admin/index", self._admin(self._index_stats))
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Open the client session, add the configured endpoints and start the background loops."""
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )
        health = self.config.health
        self.pool = EndpointPool(
            self._session,
            health_interval=health.interval_s,
            health_timeout=health.timeout_s,
            failure_threshold=health.failure_threshold,
            metrics_interval=health.metrics_interval_s,
            on_events=self._on_events,
        )
        for endpoint in self.config.endpoints:
            await self.pool.add(endpoint)
        if self.config.discovery:
            self.discovery = DnsDiscovery(self.pool, self.config.discovery)
            await self.discovery.refresh()
            self.discovery.start()
        self._maybe_start_intake()
        self.pool.start()

    async def aclose(self) -> None:
        """Stop background work and close sockets and sessions."""
        if self.discovery is not None:
            await self.discovery.aclose()
        if self.pool is not None:
            await self.pool.aclose()
        if self.intake is not None:
            await self.intake.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _on_events(self, pod: PodId, endpoint: str | None, replay: str | None) -> None:
        if endpoint is None:
            self._pending_events.pop(pod, None)
            if self.intake is not None:
                self.intake.remove_pod(pod)
            return
        if self.intake is None:
            self._pending_events[pod] = (endpoint, replay)
            self._maybe_start_intake()
        else:
            self.intake.add_pod(pod, endpoint, replay)

    def _maybe_start_intake(self) -> None:
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
        self.applier = EventApplier(
            self.index,
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
            self.intake.add_pod(pod, endpoint, replay)
        self._pending_events.clear()
        self.intake.start()

    # ------------------------------------------------------------------ OpenAI routes

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, chat=True)

    async def _route(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body larger than {self.config.max_body_bytes} bytes")
        try:
            body, pending = self._parse(raw, chat=chat)
            tenant = self._tenant(request, body)
            if isinstance(pending, list):
                tokens = pending
            elif self._is_long(body, self.config.tokenize_thread_min_chars):
                # The tokenizer releases the GIL: text prompts use another core meanwhile.
                tokens = await asyncio.to_thread(pending)
            else:
                tokens = pending()
        except RequestError as exc:
            self.metrics.errors.labels("bad_request").inc()
            return _error(exc.status, exc.message, param=exc.param)
        if tenant and body.get("cache_salt") != tenant:
            body["cache_salt"] = tenant
            raw = msgspec.json.encode(body)
        routing = RoutingRequest(
            request_id=f"r{next(self._ids)}",
            tokens=tokens,
            namespace=Namespace(self.model or str(body.get("model") or ""), self.revision or "", "", tenant),
            session_id=request.headers.get(SESSION_HEADER),
        )
        if self._index_is_remote:
            routing.prefix = await self._remote_match(routing)
        pool = self.pool
        assert pool is not None, "requests arrived before Gateway.start()"
        self.prefill_ledger.refresh(time.perf_counter())
        try:
            decision = self.scheduler.pick(routing, pool.states())
        except TierUnavailableError as exc:
            logger.warning("index unavailable, routing by load: %s", exc)
            routing.prefix = PrefixMatch(0, self.config.block_size)
            decision = self.scheduler.pick(routing, pool.states())
        self.metrics.schedule_seconds.observe(time.perf_counter() - started)
        if decision is None:
            self.metrics.errors.labels("no_endpoint").inc()
            return _error(503, "no healthy endpoint can serve this request", kind="service_unavailable")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        headers["Content-Type"] = "application/json"
        if decision.prefill is not None:
            await self._prefill(request.path, body, headers, decision.prefill)
            body = dict(body)
            body["kv_transfer_params"] = {"role": "decode"}
            raw = msgspec.json.encode(body)
        self.metrics.prompt_tokens.inc(len(tokens))
        return await self._forward(request, raw, headers, decision, routing)

    @staticmethod
    def _is_long(body: dict[str, Any], min_chars: int) -> bool:
        """Whether tokenizing ``body``'s text is worth a hop to a worker thread."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return len(prompt) >= min_chars
        if isinstance(prompt, list):
            return any(isinstance(p, str) and len(p) >= min_chars for p in prompt)
        messages = body.get("messages")
        total = 0
        for m in messages if isinstance(messages, list) else ():
            content = m.get("content") if isinstance(m, dict) else None
            total += len(content) if isinstance(content, str) else min_chars
        return total >= min_chars

    def _parse(self, raw: bytes, *, chat: bool) -> tuple[dict[str, Any], list[int] | Callable[[], list[int]]]:
        """Validate a body; returns it with its token ids, or a call that tokenizes its text."""
        if not raw:
            raise RequestError("request body is empty; expected a JSON object")
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise RequestError(f"request body is not valid JSON: not UTF-8: {exc}") from exc
        except RecursionError as exc:
            raise RequestError("request body is not valid JSON: nested too deeply") from exc
        if not isinstance(body, dict):
            raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError("'model' must be a string", param="model")
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise RequestError("'stream' must be a boolean", param="stream")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise RequestError("'cache_salt' must be a non-empty string", param="cache_salt")
        if chat:
            return body, self._chat_tokens(body.get("messages"))
        return body, self._prompt_tokens(body.get("prompt", None), "prompt" in body)

    def _prompt_tokens(self, prompt: Any, present: bool) -> list[int] | Callable[[], list[int]]:
        if not present:
            raise RequestError("'prompt' is required", param="prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str | list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("'prompt' must not be empty", param="prompt")
            tokenizer = self.tokenizer
            return [] if tokenizer is None else lambda: tokenizer.encode(prompt)
        if isinstance(prompt, list):
            if not prompt:
                raise RequestError("'prompt' must not be empty", param="prompt")
            if _is_token_list(prompt):
                return prompt
            raise RequestError(
                "'prompt' must be a string, a list of token ids in [0, 2^32), or a one-element list of either",
                param="prompt",
            )
        raise RequestError(
            f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}", param="prompt"
        )

    def _chat_tokens(self, messages: Any) -> list[int] | Callable[[], list[int]]:
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
            content = message.get("content")
            if content is not None and not isinstance(content, str | list):
                raise RequestError(
                    f"messages[{i}].content must be a string or a list of parts", param="messages"
                )
        tokenizer = self.tokenizer
        if tokenizer is None:
            return []
        return lambda: tokenizer.apply_chat_template(messages)

    @staticmethod
    def _tenant(request: web.Request, body: dict[str, Any]) -> str:
        header = request.headers.get(TENANT_HEADER)
        salt = body.get("cache_salt")
        if header is not None:
            if not header:
                raise RequestError(f"{TENANT_HEADER} must not be empty")
            if salt is not None and salt != header:
                raise RequestError(
                    f"{TENANT_HEADER} and cache_salt name different tenants", param="cache_salt"
                )
            return header
        return salt or ""

    async def _remote_match(self, routing: RoutingRequest) -> PrefixMatch:
        index = self.index

        def match() -> PrefixMatch:
            from kvmesh.router.prefix import match_prefix

            found = match_prefix(index, self.scheduler.hasher(routing.namespace), routing.tokens, self.memo)
            align = self.scheduler.align_match
            return found if align is None else align(found)

        try:
            return await asyncio.to_thread(match)
        except TierUnavailableError as exc:
            logger.warning("index unavailable, routing by load: %s", exc)
            return PrefixMatch(0, self.config.block_size)

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str], pod: PodId) -> None:
        """Run the P/D prefill leg; a failure only costs the decode endpoint the prefill work."""
        leg = dict(body)
        leg.update(stream=False, max_tokens=1, kv_transfer_params={"role": "prefill"})
        leg.pop("stream_options", None)
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        assert self._session is not None and self.pool is not None
        self.metrics.prefill_decisions.labels(pod).inc()
        self.pool.begin_request(pod)
        try:
            async with self._session.post(
                f"{pod}{path}",
                data=msgspec.json.encode(leg),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
            ) as resp:
                await resp.read()
                if resp.status != 200:
                    logger.warning("prefill leg on %s answered %d", pod, resp.status)
        except aiohttp.ClientConnectorError as exc:
            self.pool.report_failure(pod, str(exc))
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("prefill leg on %s failed: %s", pod, exc)
        finally:
            self.pool.end_request(pod)

    async def _forward(
        self,
        request: web.Request,
        raw: bytes,
        headers: dict[str, str],
        decision: Decision,
        routing: RoutingRequest,
    ) -> web.StreamResponse:
        assert self._session is not None and self.pool is not None
        pool = self.pool
        ledger = self.prefill_ledger
        rid = routing.request_id
        attempts = decision.ranked[: self.config.max_attempts]
        last_error = ""
        for n, pod in enumerate(attempts):
            endpoint = pool.get(pod)
            if endpoint is None or (n > 0 and not endpoint.state.healthy):
                continue
            pool.begin_request(pod)
            hit = routing.prefix.hit_tokens(pod) if routing.prefix is not None else 0
            ledger.sent(rid, endpoint.state, routing.num_tokens - hit, time.perf_counter())
            try:
                upstream = await self._session.post(
                    self._upstream_url(pod, request.path),
                    data=raw,
                    headers=headers,
                    timeout=self._request_timeout,
                )
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
                # Refused, reset or closed before any response: the endpoint is gone, and nothing
                # was generated for this request, so the next endpoint can take it.
                pool.end_request(pod)
                ledger.finished(rid)
                pool.report_failure(pod, str(exc))
                self.metrics.retries.inc()
                last_error = f"{pod}: {exc}"
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                pool.end_request(pod)
                ledger.finished(rid)
                self.metrics.errors.labels("upstream").inc()
                return _error(502, f"endpoint {pod} failed: {exc}", kind="upstream_error")
            self.metrics.count_decision(pod)
            if pod == decision.endpoint:
                self.metrics.predicted_hit_tokens.inc(decision.predicted_hit_tokens)
            try:
                return await self._relay(request, upstream, pod, rid)
            finally:
                upstream.release()
                pool.end_request(pod)
                ledger.finished(rid)
        self.metrics.errors.labels("unreachable").inc()
        return _error(502, f"no endpoint could be reached ({last_error})", kind="upstream_error")

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, pod: PodId, request_id: str
    ) -> web.StreamResponse:
        content_type = upstream.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.metrics.errors.labels("upstream").inc()
                return _error(502, f"endpoint {pod} failed mid-response: {exc}", kind="upstream_error")
            self._record_usage(data)
            resp = web.Response(status=upstream.status, body=data, headers={"Content-Type": content_type})
            resp.headers[ENDPOINT_HEADER] = pod
            return resp
        stream = web.StreamResponse(status=upstream.status)
        stream.headers["Content-Type"] = content_type
        stream.headers["Cache-Control"] = "no-cache"
        stream.headers[ENDPOINT_HEADER] = pod
        await stream.prepare(request)
        tail = b""
        first = upstream.status == 200
        try:
            async for chunk in upstream.content.iter_any():
                if first:
                    # An engine streams nothing before its first token: this is the prefill's end.
                    self.prefill_ledger.first_token(request_id, time.perf_counter())
                    first = False
                await stream.write(chunk)
                tail = (tail + chunk)[-_USAGE_TAIL:]
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.metrics.errors.labels("upstream").inc()
            logger.warning("stream from %s broke: %s", pod, exc)
            with contextlib.suppress(ConnectionResetError):
                await stream.write(b'data: {"error": {"message": "upstream endpoint failed mid-stream"}}\n\n')
            return stream
        except ConnectionResetError:
            return stream
        self._record_stream_usage(tail)
        with contextlib.suppress(ConnectionResetError):
            await stream.write_eof()
        return stream

    def _record_usage(self, data: bytes) -> None:
        try:
            body = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return
        self._count_cached(body)

    def _record_stream_usage(self, tail: bytes) -> None:
        for line in reversed(tail.split(b"\n")):
            if line.startswith(b"data: {") and b'"usage"' in line:
                with contextlib.suppress(msgspec.DecodeError):
                    self._count_cached(msgspec.json.decode(line[6:]))
                return

    def _count_cached(self, body: Any) -> None:
        if not isinstance(body, dict):
            return
        usage = body.get("usage")
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(cached) is int and cached > 0:
            self.metrics.realized_hit_tokens.inc(cached)

    async def _models(self, request: web.Request) -> web.Response:
        assert self._session is not None and self.pool is not None
        for state in self.pool.states():
            if not state.healthy:
                continue
            try:
                async with self._session.get(
                    f"{state.pod}/v1/models", timeout=aiohttp.ClientTimeout(total=2.0)
                ) as resp:
                    if resp.status == 200:
                        return web.Response(body=await resp.read(), content_type="application/json")
            except (aiohttp.ClientError, TimeoutError):
                continue
        if self.model is None:
            return _error(503, "no healthy endpoint and no configured model", kind="service_unavailable")
        body = {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "kvmesh"}]}
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        states = self.pool.states() if self.pool is not None else []
        healthy = sum(1 for s in states if s.healthy)
        body = {
            "status": "ok" if healthy else "no healthy endpoint",
            "endpoints": len(states),
            "healthy": healthy,
        }
        return web.Response(
            status=200 if healthy else 503, body=msgspec.json.encode(body), content_type="application/json"
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(self.metrics.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    # ------------------------------------------------------------------ admin API

    def _admin(
        self, handler: Callable[[web.Request], Awaitable[web.Response]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def guarded(request: web.Request) -> web.Response:
            token = self.config.admin_token
            if not token:
                return _error(403, "the admin API is disabled (no admin token configured)", kind="forbidden")
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return _error(401, "missing or wrong bearer token", kind="unauthorized")
            try:
                return await handler(request)
            except RequestError as exc:
                return _error(exc.status, exc.message, param=exc.param)

        return guarded

    async def _json_body(self, request: web.Request) -> Any:
        try:
            return msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from exc

    async def _list_endpoints(self, request: web.Request) -> web.Response:
        assert self.pool is not None
        out = []
        for e in self.pool.endpoints:
            item = asdict(e.state)
            item.update(
                events_endpoint=e.events_endpoint,
                replay_endpoint=e.replay_endpoint,
                last_error=e.last_error,
                indexed_blocks=self.applier.num_blocks(e.state.pod) if self.applier is not None else 0,
                block_size=self.applier.pod_block_size(e.state.pod) if self.applier is not None else None,
            )
            out.append(item)
        return web.Response(body=msgspec.json.encode({"endpoints": out}), content_type="application/json")

    async def _add_endpoint(self, request: web.Request) -> web.Response:
        assert self.pool is not None
        try:
            config = msgspec.convert(await self._json_body(request), type=EndpointConfig)
        except msgspec.ValidationError as exc:
            raise RequestError(f"invalid endpoint: {exc}") from exc
        try:
            endpoint = await self.pool.add(config)
        except ConfigError as exc:
            raise RequestError(str(exc)) from exc
        self._maybe_start_intake()
        body = {
            "added": endpoint.state.pod,
            "healthy": endpoint.state.healthy,
            "events_endpoint": endpoint.events_endpoint,
        }
        return web.Response(status=201, body=msgspec.json.encode(body), content_type="application/json")

    async def _remove_endpoint(self, request: web.Request) -> web.Response:
        assert self.pool is not None
        url = request.query.get("url")
        if url is None:
            body = await self._json_body(request) if request.can_read_body else None
            url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str):
            raise RequestError('give the endpoint as ?url=... or {"url": ...}', param="url")
        try:
            pod = normalize_url(url)
        except ConfigError as exc:
            raise RequestError(str(exc), param="url") from exc
        if not self.pool.remove(pod):
            raise RequestError(f"no endpoint {pod}", status=404, param="url")
        return web.Response(body=msgspec.json.encode({"removed": pod}), content_type="application/json")

    async def _flush(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if not isinstance(body, dict) or not body:
            raise RequestError('give {"pod": url} or {"tenant": ..., "lora": ...}')
        if self.applier is None:
            return web.Response(body=msgspec.json.encode({"flushed": 0}), content_type="application/json")
        if "pod" in body:
            if not isinstance(body["pod"], str):
                raise RequestError("'pod' must be a URL string", param="pod")
            try:
                pod = normalize_url(body["pod"])
            except ConfigError as exc:
                raise RequestError(str(exc), param="pod") from exc
            flushed = self.applier.drop_pod(pod)
        else:
            tenant, lora = body.get("tenant"), body.get("lora")
            if not all(v is None or isinstance(v, str) for v in (tenant, lora)) or (
                tenant is None and lora is None
            ):
                raise RequestError("'tenant' and 'lora' must be strings, at least one given")
            flushed = self.applier.flush_namespace(lora=lora, tenant=tenant)
        return web.Response(body=msgspec.json.encode({"flushed": flushed}), content_type="application/json")

    async def _index_stats(self, request: web.Request) -> web.Response:
        stats = await asyncio.to_thread(self.index.stats) if self._index_is_remote else self.index.stats()
        body: dict[str, Any] = {"index": asdict(stats)}
        if self.applier is not None:
            body["ingest"] = asdict(self.applier.stats)
            body["model"] = self.applier.model
            body["block_size"] = self.applier.block_size
            body["pods"] = self.applier.pod_stats()
        if self.intake is not None:
            body["subscriber"] = asdict(self.intake.subscriber.stats)
        if isinstance(self.tokenizer, CachedTokenizer):
            body["tokenizer"] = self.tokenizer.stats()
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")
