"""The admin API, behind a bearer token: endpoints, index flushes, index statistics, cache usage.

Routes: ``GET``/``POST``/``DELETE /admin/endpoints``, ``POST /admin/flush``, ``GET /admin/index``,
``GET /admin/usage`` (per-tenant prompt, cached and prewarmed tokens), ``GET /admin/explain``
(the latest requests' ``x-kvmesh-cache``) and ``GET /admin/explain/{request_id}`` (one request's
cache verdict with every endpoint's scores). Without a configured token every route answers 403.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, asdict, dataclass, replace
from typing import Any, Protocol

import msgspec
from aiohttp import web

from kvmesh.core.types import PodId
from kvmesh.errors import ConfigError, RequestError
from kvmesh.router.cache_report import CacheReporter
from kvmesh.router.endpoints import Endpoint, EndpointConfig, normalize_url
from kvmesh.router.index import SHARED_TIER_HOLDER
from kvmesh.router.ingest import EventApplier
from kvmesh.router.replies import error_response, json_response

Handler = Callable[[web.Request], Awaitable[web.Response]]


class AdminSubject(Protocol):
    """What the admin routes read and change of a router."""

    applier: EventApplier | None
    """The event applier (``None`` until the namespace's model is known)."""

    def endpoints(self) -> list[Endpoint]:
        """The endpoints in the pool."""
        ...

    async def add_endpoint(self, config: EndpointConfig) -> Endpoint:
        """Add (or replace) an endpoint.

        Raises:
            ConfigError: the endpoint's config is unusable.
        """
        ...

    def remove_endpoint(self, pod: PodId) -> bool:
        """Remove an endpoint; ``False`` when it was not in the pool."""
        ...

    async def index_report(self) -> dict[str, Any]:
        """Statistics of the index, event ingestion and prompt tokenization."""
        ...


@dataclass(slots=True, eq=False)
class AdminApi:
    """The admin routes of one router.

    Args:
        router: the endpoints, event applier and index the routes read and change.
        token: the bearer token the routes require (``None`` or empty: every route answers 403).
        cache_report: answers ``/admin/usage`` and ``/admin/explain``.
        explain_history: how many answered requests ``cache_report`` explains.
    """

    router: AdminSubject
    _: KW_ONLY
    token: str | None
    cache_report: CacheReporter
    explain_history: int

    def register(self, app: web.Application) -> None:
        """Add the admin routes to ``app``."""
        app.router.add_get("/admin/endpoints", self._guard(self._list_endpoints))
        app.router.add_post("/admin/endpoints", self._guard(self._add_endpoint))
        app.router.add_delete("/admin/endpoints", self._guard(self._remove_endpoint))
        app.router.add_post("/admin/flush", self._guard(self._flush))
        app.router.add_get("/admin/index", self._guard(self._index_stats))
        app.router.add_get("/admin/usage", self._guard(self._usage))
        app.router.add_get("/admin/explain", self._guard(self._recent))
        app.router.add_get("/admin/explain/{request_id}", self._guard(self._explain))

    def _guard(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.Response:
            token = self.token
            if not token:
                return error_response(
                    403, "the admin API is disabled (no admin token configured)", kind="forbidden"
                )
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return error_response(401, "missing or wrong bearer token", kind="unauthorized")
            try:
                return await handler(request)
            except RequestError as exc:
                return error_response(exc.status, exc.message, param=exc.param)

        return guarded

    async def _list_endpoints(self, request: web.Request) -> web.Response:
        applier = self.router.applier
        out = []
        for e in self.router.endpoints():
            # the release forecast is live bookkeeping, not a figure (and not JSON)
            item = asdict(replace(e.state, kv_releases=None))
            del item["kv_releases"]
            item.update(
                events_endpoint=e.events_endpoint,
                replay_endpoint=e.replay_endpoint,
                last_error=e.last_error,
                indexed_blocks=applier.num_blocks(e.state.pod) if applier is not None else 0,
                block_size=applier.pod_block_size(e.state.pod) if applier is not None else None,
            )
            out.append(item)
        return json_response({"endpoints": out})

    async def _add_endpoint(self, request: web.Request) -> web.Response:
        try:
            config = msgspec.convert(await _json_body(request), type=EndpointConfig)
        except msgspec.ValidationError as exc:
            raise RequestError(f"invalid endpoint: {exc}") from exc
        try:
            endpoint = await self.router.add_endpoint(config)
        except ConfigError as exc:
            raise RequestError(str(exc)) from exc
        body = {
            "added": endpoint.state.pod,
            "healthy": endpoint.state.healthy,
            "events_endpoint": endpoint.events_endpoint,
        }
        return json_response(body, status=201)

    async def _remove_endpoint(self, request: web.Request) -> web.Response:
        url = request.query.get("url")
        if url is None:
            body = await _json_body(request) if request.can_read_body else None
            url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str):
            raise RequestError('give the endpoint as ?url=... or {"url": ...}', param="url")
        try:
            pod = normalize_url(url)
        except ConfigError as exc:
            raise RequestError(str(exc), param="url") from exc
        if not self.router.remove_endpoint(pod):
            raise RequestError(f"no endpoint {pod}", status=404, param="url")
        return json_response({"removed": pod})

    async def _flush(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not isinstance(body, dict) or not body:
            raise RequestError('give {"pod": url}, {"shared": true} or {"tenant": ..., "lora": ...}')
        applier = self.router.applier
        if applier is None:
            return json_response({"flushed": 0})
        if "shared" in body:
            # The fleet's shared tier was emptied (a Redis FLUSHALL, a wiped directory): forget what
            # its announcements credited to every endpoint.
            if body["shared"] is not True:
                raise RequestError("'shared' must be true", param="shared")
            flushed = applier.drop_pod(SHARED_TIER_HOLDER)
        elif "pod" in body:
            if not isinstance(body["pod"], str):
                raise RequestError("'pod' must be a URL string", param="pod")
            try:
                pod = normalize_url(body["pod"])
            except ConfigError as exc:
                raise RequestError(str(exc), param="pod") from exc
            flushed = applier.drop_pod(pod)
        else:
            tenant, lora = body.get("tenant"), body.get("lora")
            if not all(v is None or isinstance(v, str) for v in (tenant, lora)) or (
                tenant is None and lora is None
            ):
                raise RequestError("'tenant' and 'lora' must be strings, at least one given")
            flushed = applier.flush_namespace(lora=lora, tenant=tenant)
        return json_response({"flushed": flushed})

    async def _index_stats(self, request: web.Request) -> web.Response:
        return json_response(await self.router.index_report())

    async def _usage(self, request: web.Request) -> web.Response:
        ledger = self.cache_report.ledger
        return json_response({"tenants": ledger.snapshot(), "max_tenants": ledger.max_tenants})

    async def _recent(self, request: web.Request) -> web.Response:
        raw = request.query.get("limit", "50")
        if not raw.isdigit():
            raise RequestError("'limit' must be a non-negative integer", param="limit")
        return json_response({"requests": self.cache_report.recent(int(raw))})

    async def _explain(self, request: web.Request) -> web.Response:
        request_id = request.match_info["request_id"]
        entry = self.cache_report.explain(request_id)
        if entry is None:
            raise RequestError(
                f"no request {request_id!r} among the last {self.explain_history} answered",
                status=404,
                param="request_id",
            )
        return json_response(entry)


async def _json_body(request: web.Request) -> Any:
    try:
        return msgspec.json.decode(await request.read())
    except msgspec.DecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
