"""The workers of ``kvmesh router --workers N`` answer as one router.

Each worker is a whole gateway on the shared port; a client reaches whichever one the kernel picks.
Without this, ``/metrics`` would be one worker's counters (a Prometheus scrape landing on another
worker next time reads as a counter reset), an endpoint added through ``/admin/endpoints`` would
reach one worker, and ``/admin/explain/{id}`` would find only the requests that worker answered.

Every worker also serves its app on a unix socket of its own (``worker-<i>.sock`` in the
supervisor's private temporary directory), and a middleware on the shared port:

- ``GET /metrics``: this worker's exposition and every peer's, each sample labelled
  ``worker="<i>"``, with ``kvmesh_router_workers`` (N) and ``kvmesh_router_workers_scraped`` (how
  many answered within :data:`PEER_TIMEOUT_S`; a worker that is restarting is left out).
- ``POST``/``DELETE …/admin/endpoints`` and ``POST …/admin/flush`` (also under ``/pools/<name>``):
  applied here, then sent to every peer; the answer says per worker how it went (``workers``).
- ``GET …/admin/explain/{id}``: a request this worker did not answer is looked up on the peers.
- ``GET …/admin/usage``: every worker's per-tenant counts, added up.
- ``GET …/admin/explain``: every worker's latest requests, newest first (``worker`` on each).
- ``GET …/admin/index``: this worker's index and ingestion report, every peer's under ``peers``.

A worker that starts again (after a crash, or one at a time in a rolling restart) copies the
endpoint list from the first peer that answers: endpoints added at run time are added, configured
endpoints removed at run time are removed. Requests a peer forwards carry :data:`LOCAL_HEADER`
and are answered by the worker alone (only over its unix socket: from a client, the header is
ignored).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvmesh.router.endpoints import normalize_url

log = logging.getLogger(__name__)

LOCAL_HEADER = "x-kvmesh-worker-local"
"""Set on requests between workers: the receiving worker answers alone."""
STARTED_HEADER = "x-kvmesh-worker-started"
"""On answers to :data:`LOCAL_HEADER` requests: when the answering worker started (Unix time)."""
PEER_TIMEOUT_S = 2.0
"""How long a worker waits for a peer's answer."""
CATCH_UP_S = 15.0
"""How long a starting worker keeps asking its peers for the endpoint list."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def worker_socket(directory: str, index: int) -> str:
    """The unix socket worker ``index`` serves its app on."""
    return str(Path(directory) / f"worker-{index}.sock")


def merge_expositions(pages: Mapping[int, str], num_workers: int) -> bytes:
    """One exposition of every worker's families, each sample labelled with its worker."""
    families: dict[str, Metric] = {}
    for worker, text in sorted(pages.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            label = str(worker)
            merged.samples.extend(
                Sample(s.name, {**s.labels, "worker": label}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    total = GaugeMetricFamily("kvmesh_router_workers", "Worker processes of this router")
    total.add_metric([], num_workers)
    scraped = GaugeMetricFamily(
        "kvmesh_router_workers_scraped", "Workers whose metrics are on this page (the others did not answer)"
    )
    scraped.add_metric([], len(pages))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families.values(), total, scraped]))
    return generate_latest(registry)


def add_counts(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """``a`` and ``b`` with the numbers under the same keys added, at any depth (usage rows)."""
    out = dict(a)
    for key, value in b.items():
        mine = out.get(key)
        if isinstance(value, Mapping) and isinstance(mine, Mapping):
            out[key] = add_counts(mine, value)
        elif isinstance(value, int | float) and isinstance(mine, int | float):
            out[key] = mine + value
        elif key not in out:
            out[key] = value
    return out


def _plain_body(answer: web.StreamResponse, max_status: int) -> bytes | None:
    """The body of a local answer to merge with the peers' (``None``: a streamed answer, or one
    whose status is above ``max_status``, which is passed on untouched)."""
    if answer.status > max_status or not isinstance(answer, web.Response):
        return None
    return answer.body if isinstance(answer.body, bytes) else None


def _over_unix_socket(request: web.Request) -> bool:
    """Whether ``request`` came over a unix socket: a peer's, or the router's front relaying a
    client's request (which drops :data:`LOCAL_HEADER`). A client on the TCP port that sends the
    header is answered by every worker as any other client."""
    transport = request.transport
    return transport is not None and isinstance(transport.get_extra_info("sockname"), str)


class PeerAnswer(NamedTuple):
    status: int
    body: bytes
    started_at: float
    """When the answering worker started (0 when it did not say)."""


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


class WorkerMesh:
    """Makes worker ``index`` of ``num_workers`` answer for all of them (see the module docstring).

    Args:
        index: this worker's index.
        num_workers: how many workers share the port.
        directory: where the workers' unix sockets are.
        admin_token: the admin API's bearer token (``None``: no admin change can happen, so a
            starting worker has nothing to catch up).
        configured: per admin prefix (``""``, or ``/pools/<name>``), the endpoint URLs of the
            config: a starting worker removes those its peer no longer has.
    """

    def __init__(
        self,
        index: int,
        num_workers: int,
        directory: str,
        *,
        admin_token: str | None,
        configured: Mapping[str, Iterable[str]],
    ) -> None:
        self.index = index
        self.num_workers = num_workers
        self.directory = directory
        self.admin_token = admin_token
        self.configured = {prefix: {normalize_url(u) for u in urls} for prefix, urls in configured.items()}
        self.started_at = time.time()
        self._sessions: dict[int, aiohttp.ClientSession] = {}
        self._catch_up: asyncio.Task[None] | None = None
        self.num_endpoints_adopted = 0
        self.num_endpoints_dropped = 0

    @property
    def socket_path(self) -> str:
        """The unix socket this worker serves on."""
        return worker_socket(self.directory, self.index)

    @property
    def peers(self) -> list[int]:
        return [i for i in range(self.num_workers) if i != self.index]

    def install(self, app: web.Application) -> None:
        """Add the middleware and the start-up catch-up to ``app`` (before it starts), and remove
        the socket this worker's previous process left."""
        Path(self.socket_path).unlink(missing_ok=True)
        app.middlewares.append(self._middleware)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)

    # ------------------------------------------------------------------ requests on the shared port

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if LOCAL_HEADER in request.headers and _over_unix_socket(request):
            answer = await handler(request)
            if not answer.prepared:
                answer.headers[STARTED_HEADER] = repr(self.started_at)
            return answer
        path, method = request.path, request.method
        if method == "GET" and path == "/metrics":
            return await self._metrics(request, handler)
        if (method in ("POST", "DELETE") and path.endswith("/admin/endpoints")) or (
            method == "POST" and path.endswith("/admin/flush")
        ):
            return await self._everywhere(request, handler)
        if method == "GET" and "/admin/explain/" in path:
            return await self._wherever_found(request, handler)
        if method == "GET" and path.endswith("/admin/usage"):
            return await self._gathered(request, handler, self._summed_usage)
        if method == "GET" and path.endswith("/admin/explain"):
            return await self._gathered(request, handler, self._merged_recent)
        if method == "GET" and path.endswith("/admin/index"):
            return await self._gathered(request, handler, self._every_index)
        return await handler(request)

    async def _metrics(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        own = await handler(request)
        body = _plain_body(own, 200)
        if body is None:
            return own
        pages = {self.index: body.decode()}
        answers = await asyncio.gather(*(self._ask(i, "GET", "/metrics") for i in self.peers))
        for i, answer in zip(self.peers, answers, strict=True):
            if answer is not None and answer.status == 200:
                pages[i] = answer.body.decode()
        resp = web.Response(body=merge_expositions(pages, self.num_workers))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    async def _everywhere(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        body = await request.read()  # kept by the request: the handler reads it again
        own = await handler(request)
        own_body = _plain_body(own, 299)
        if own_body is None:
            return own
        _, workers = await self._ask_peers(request, own.status, body, ("authorization", "content-type"))
        try:
            content = json.loads(own_body)
        except ValueError:
            return own
        if isinstance(content, dict):
            content["workers"] = workers
        return web.json_response(content, status=own.status)

    async def _gathered(
        self,
        request: web.Request,
        handler: Handler,
        combine: Callable[[dict[str, Any], dict[int, Any], web.Request], dict[str, Any]],
    ) -> web.StreamResponse:
        """This worker's JSON answer to a ``GET`` merged by ``combine`` with those of the peers that
        answered 200 (by worker), and ``workers``: who answered how."""
        own = await handler(request)
        own_body = _plain_body(own, 200)
        if own_body is None:
            return own
        answers, workers = await self._ask_peers(request, own.status, None, ("authorization",))
        theirs = {
            i: json.loads(answer.body)
            for i, answer in zip(self.peers, answers, strict=True)
            if answer is not None and answer.status == 200
        }
        content = combine(json.loads(own_body), theirs, request)
        content["workers"] = workers
        return web.json_response(content)

    @staticmethod
    def _summed_usage(own: dict[str, Any], theirs: dict[int, Any], request: web.Request) -> dict[str, Any]:
        for usage in theirs.values():
            own["tenants"] = add_counts(own["tenants"], usage["tenants"])
        return own

    def _merged_recent(
        self, own: dict[str, Any], theirs: dict[int, Any], request: web.Request
    ) -> dict[str, Any]:
        """The latest requests of every worker, newest first, each labelled with its worker."""
        recent = [{**entry, "worker": self.index} for entry in own["requests"]]
        for i, answer in theirs.items():
            recent.extend({**entry, "worker": i} for entry in answer["requests"])
        limit = int(request.query.get("limit", "50"))  # the handler accepted it
        recent.sort(key=lambda entry: entry.get("at", 0.0), reverse=True)
        return {"requests": recent[:limit]}

    def _every_index(
        self, own: dict[str, Any], theirs: dict[int, Any], request: web.Request
    ) -> dict[str, Any]:
        """This worker's index report, with every peer's under ``peers``."""
        return {**own, "worker": self.index, "peers": {str(i): report for i, report in theirs.items()}}

    async def _ask_peers(
        self, request: web.Request, own_status: int, body: bytes | None, forwarded: tuple[str, ...]
    ) -> tuple[list[PeerAnswer | None], dict[str, int | str]]:
        """Every peer's answer to ``request`` (with its ``forwarded`` headers), and per worker, this
        one included, the status it answered with (``"unreachable"``: none)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in forwarded}
        answers = await asyncio.gather(
            *(self._ask(i, request.method, request.path_qs, body, headers) for i in self.peers)
        )
        workers: dict[str, int | str] = {str(self.index): own_status}
        for i, answer in zip(self.peers, answers, strict=True):
            workers[str(i)] = "unreachable" if answer is None else answer.status
        return list(answers), workers

    async def _wherever_found(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        own = await handler(request)
        if own.status != 404:
            return own
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for i in self.peers:
            answer = await self._ask(i, "GET", request.path_qs, headers=headers)
            if answer is not None and answer.status == 200:
                return web.Response(body=answer.body, content_type="application/json")
        return own

    async def _ask(
        self,
        worker: int,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> PeerAnswer | None:
        """``worker``'s answer to one request; ``None`` when it does not answer."""
        session = self._sessions.get(worker)
        if session is None or session.closed:
            session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=worker_socket(self.directory, worker)),
                timeout=aiohttp.ClientTimeout(total=PEER_TIMEOUT_S),
            )
            self._sessions[worker] = session
        try:
            async with session.request(
                method,
                f"http://worker-{worker}{path}",
                data=body,
                headers={**(headers or {}), LOCAL_HEADER: "1"},
            ) as resp:
                started = resp.headers.get(STARTED_HEADER, "")
                return PeerAnswer(resp.status, await resp.read(), float(started) if started else 0.0)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    # ------------------------------------------------------------------ catching up on start

    async def _on_startup(self, app: web.Application) -> None:
        if self.admin_token and self.peers:
            self._catch_up = asyncio.create_task(self._adopt_peer_endpoints(), name="worker-mesh-catch-up")

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._catch_up is not None:
            self._catch_up.cancel()
            await asyncio.gather(self._catch_up, return_exceptions=True)
        for session in self._sessions.values():
            await session.close()

    async def _adopt_peer_endpoints(self) -> None:
        """Make this worker's endpoint lists those of a peer that started before it (see the module
        docstring). A peer that started later has nothing this worker lacks: every admin change
        since reached this worker too, or came after that peer copied its list from an older one."""
        auth = {"Authorization": f"Bearer {self.admin_token}"}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CATCH_UP_S
        while True:
            # this worker's own socket opens once its startup is over, which is what is compared
            own = await self._endpoint_lists(self.index, auth)
            if own is not None:
                answered = 0
                for peer in self.peers:
                    theirs = await self._endpoint_lists(peer, auth)
                    if theirs is None:
                        continue
                    answered += 1
                    started_at, lists = theirs
                    if started_at < self.started_at:
                        await self._adopt(own[1], lists, auth)
                        return
                if answered == len(self.peers):
                    return
            if loop.time() > deadline:
                log.warning("no peer worker answered in %.0f s: endpoint list as configured", CATCH_UP_S)
                return
            await asyncio.sleep(0.5)

    async def _endpoint_lists(
        self, worker: int, auth: Mapping[str, str]
    ) -> tuple[float, dict[str, list[Any]]] | None:
        """When ``worker`` started, and its endpoint list per admin prefix."""
        lists = {}
        started_at = 0.0
        for prefix in self.configured:
            answer = await self._ask(worker, "GET", f"{prefix}/admin/endpoints", headers=auth)
            if answer is None or answer.status != 200:
                return None
            started_at = answer.started_at
            lists[prefix] = json.loads(answer.body)["endpoints"]
        return started_at, lists

    async def _adopt(
        self, own_lists: Mapping[str, list[Any]], peer_lists: Mapping[str, list[Any]], auth: Mapping[str, str]
    ) -> None:
        json_auth = {**auth, "Content-Type": "application/json"}
        for prefix, peer_list in peer_lists.items():
            own = {item["pod"] for item in own_lists[prefix]}
            theirs = {item["pod"] for item in peer_list}
            for item in peer_list:
                if item["pod"] in own:
                    continue
                body = {"url": item["pod"], "role": item.get("role")}
                if item.get("events_endpoint"):
                    body["eventsEndpoint"] = item["events_endpoint"]
                if item.get("replay_endpoint"):
                    body["replayEndpoint"] = item["replay_endpoint"]
                answer = await self._ask(
                    self.index, "POST", f"{prefix}/admin/endpoints", json.dumps(body).encode(), json_auth
                )
                if answer is not None and answer.status < 300:
                    self.num_endpoints_adopted += 1
            for pod in own - theirs:
                if pod in self.configured[prefix]:
                    query = urllib.parse.urlencode({"url": pod})
                    answer = await self._ask(
                        self.index, "DELETE", f"{prefix}/admin/endpoints?{query}", headers=auth
                    )
                    if answer is not None and answer.status < 300:
                        self.num_endpoints_dropped += 1
        log.info(
            "worker %d caught up with its peers: %d endpoints added, %d removed",
            self.index,
            self.num_endpoints_adopted,
            self.num_endpoints_dropped,
        )
