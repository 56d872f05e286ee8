"""Forwarding a routed request upstream: retries down the ranking, the answer relayed back.

A connect failure (refused, reset or closed before any response) marks the endpoint down and the
request goes to the next ranked endpoint, since nothing was generated for it yet; any later failure
is the client's 502. SSE is relayed chunk by chunk and never buffered; a stream's answer starts
with the engine's first chunk (engines send nothing before their first token), so its headers
can carry what the engine reported by then. The engines'
``usage.prompt_tokens_details.cached_tokens`` is counted as the realized prefix hits, and with a
:class:`~kvmesh.router.cache_report.CacheReporter` every answer gets ``x-kvmesh-cache`` and
``x-request-id``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from aiohttp import web

from kvmesh.core.cache_usage import CACHE_HEADER, ENGINE_CACHED_HEADER, REQUEST_ID_HEADER, CacheUsage
from kvmesh.core.tenancy import ENDPOINT_HEADER
from kvmesh.core.types import PodId
from kvmesh.errors import UpstreamError, UpstreamUnreachableError
from kvmesh.router.cache_report import CacheNote, CacheReporter
from kvmesh.router.client_request import ClientRequest, open_stream
from kvmesh.router.endpoints import EndpointPool
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.prefill_ledger import PrefillLedger
from kvmesh.router.replies import error_response
from kvmesh.router.types import Decision, RoutingRequest
from kvmesh.router.upstream_http import UpstreamClient, UpstreamResponse

logger = logging.getLogger(__name__)

_USAGE_TAIL = 16 * 1024
"""Bytes of a stream's end kept to find its usage chunk."""


class _StreamTail:
    """The last :data:`_USAGE_TAIL` bytes of a stream, kept as its chunks (no copy per chunk)."""

    __slots__ = ("chunks", "size")

    def __init__(self) -> None:
        self.chunks: collections.deque[bytes] = collections.deque()
        self.size = 0

    def add(self, chunk: bytes) -> None:
        chunks = self.chunks
        chunks.append(chunk)
        self.size += len(chunk)
        while self.size - len(chunks[0]) >= _USAGE_TAIL:
            self.size -= len(chunks.popleft())

    def value(self) -> bytes:
        return b"".join(self.chunks)[-_USAGE_TAIL:]


class _UsageOnly(msgspec.Struct):
    """An answer's top-level ``usage``: the rest (the generated text) is skipped, not built."""

    usage: Any = None


_USAGE_DECODER = msgspec.json.Decoder(_UsageOnly)


class UpstreamProxy:
    """Sends requests to endpoints and relays their answers.

    Args:
        client: the HTTP client to the endpoints.
        pool: the endpoints; failures are reported to it and in-flight requests counted on it.
        metrics: where retries, errors, decisions and hits are counted.
        ledger: the outstanding prefill work per endpoint (sent, first token, finished).
        request_timeout_s: total time one upstream request may take.
        max_attempts: endpoints tried per request, down the ranking.
        on_first_token: called when a streamed request's first token arrives (flow control
            re-checks its queue then).
        reporter: explains and counts each answer's cache use (``None``: no cache headers).
    """

    def __init__(
        self,
        client: UpstreamClient,
        pool: EndpointPool,
        metrics: RouterMetrics,
        ledger: PrefillLedger,
        *,
        request_timeout_s: float,
        max_attempts: int,
        on_first_token: Callable[[], None] | None = None,
        reporter: CacheReporter | None = None,
    ) -> None:
        self.client = client
        self.pool = pool
        self.metrics = metrics
        self.ledger = ledger
        self.max_attempts = max_attempts
        self.on_first_token = on_first_token
        self.reporter = reporter
        self.request_timeout_s = request_timeout_s

    async def forward(
        self,
        request: ClientRequest,
        raw: bytes,
        headers: dict[str, str],
        decision: Decision,
        routing: RoutingRequest,
        response_headers: Mapping[str, str] | None = None,
        note: CacheNote | None = None,
        *,
        path: str | None = None,
    ) -> web.StreamResponse:
        """Send ``raw`` to ``decision.ranked[0]`` (then the next on connect failures) and relay the answer.

        Args:
            request: the client's request (streams are opened on it).
            raw: the body to send.
            headers: the headers to send.
            decision: the scheduler's decision.
            routing: the routed request (its id and predicted hits feed the prefill ledger).
            response_headers: added to the answer relayed from the endpoint.
            note: the request's cache note (settled with the engine's figures).
            path: the endpoints' route to post to (``None``: the client's request path).

        Returns:
            The relayed answer, or a 502 when no endpoint could be reached.
        """
        pool = self.pool
        ledger = self.ledger
        rid = routing.request_id
        last_error = ""
        if path is None:
            path = request.path
        for n, pod in enumerate(decision.ranked[: self.max_attempts]):
            endpoint = pool.get(pod)
            if endpoint is None or (n > 0 and not endpoint.state.healthy):
                continue
            pool.begin_request(pod)
            hit = routing.prefix.hit_tokens(pod) if routing.prefix is not None else 0
            now = time.perf_counter()
            ledger.sent(rid, endpoint.state, routing.num_tokens - hit, now, cached=hit)
            if ledger.sessions is not None:
                ledger.sessions.routed(routing, endpoint.state, now)
            try:
                upstream = await self.client.post(pod, path, raw, headers, timeout_s=self.request_timeout_s)
            except UpstreamUnreachableError as exc:
                # Refused, reset or closed before any response: the endpoint is gone, and nothing
                # was generated for this request, so the next endpoint can take it.
                pool.end_request(pod)
                ledger.finished(rid)
                pool.report_failure(pod, str(exc))
                self.metrics.retries.inc()
                last_error = f"{pod}: {exc}"
                continue
            except (UpstreamError, TimeoutError, ValueError) as exc:  # ValueError: not an http(s) URL
                pool.end_request(pod)
                ledger.finished(rid)
                self.metrics.errors.labels("upstream").inc()
                return error_response(502, f"endpoint {pod} failed: {exc}", kind="upstream_error")
            self.metrics.count_decision(pod)
            if pod == decision.endpoint and decision.predicted_hit_tokens:
                self.metrics.predicted_hit_tokens.inc(decision.predicted_hit_tokens)
            try:
                return await self._relay(request, upstream, pod, rid, response_headers, note)
            finally:
                upstream.release()
                pool.end_request(pod)
                ledger.finished(rid)
                ledger.released(rid, endpoint.state, routing.num_tokens, time.perf_counter())
        self.metrics.errors.labels("unreachable").inc()
        return error_response(502, f"no endpoint could be reached ({last_error})", kind="upstream_error")

    async def _relay(
        self,
        request: ClientRequest,
        upstream: UpstreamResponse,
        pod: PodId,
        request_id: str,
        response_headers: Mapping[str, str] | None,
        note: CacheNote | None,
    ) -> web.StreamResponse:
        content_type = upstream.headers.get("content-type", "application/json")
        if not content_type.startswith("text/event-stream"):
            try:
                data = await upstream.read()
            except (UpstreamError, TimeoutError) as exc:
                self.metrics.errors.labels("upstream").inc()
                return error_response(
                    502, f"endpoint {pod} failed mid-response: {exc}", kind="upstream_error"
                )
            usage = self._record_usage(data)
            # One dict, turned into the response's header multidict once.
            headers = {"Content-Type": content_type, ENDPOINT_HEADER: pod}
            if response_headers:
                headers.update(response_headers)
            if note is not None:
                headers[REQUEST_ID_HEADER] = note.request_id
                if upstream.status == 200 and self.reporter is not None:
                    headers[CACHE_HEADER] = self.reporter.finish(note, pod, usage).header_value()
            return web.Response(status=upstream.status, body=data, headers=headers)
        chunks = upstream.iter_chunks()
        try:
            # The client's answer starts with the engine's first chunk: by then the engine's
            # headers are in, and the router's can say what it reported.
            head = await anext(chunks, b"")
        except (UpstreamError, TimeoutError) as exc:
            self.metrics.errors.labels("upstream").inc()
            return error_response(
                502, f"endpoint {pod} failed before streaming: {exc}", kind="upstream_error"
            )
        stream = web.StreamResponse(status=upstream.status)
        stream.headers["Content-Type"] = content_type
        stream.headers["Cache-Control"] = "no-cache"
        stream.headers[ENDPOINT_HEADER] = pod
        if response_headers:
            stream.headers.update(response_headers)
        reported = CacheUsage.from_header(upstream.headers.get(ENGINE_CACHED_HEADER))  # lowercase name
        ok = upstream.status == 200
        if note is not None:
            stream.headers[REQUEST_ID_HEADER] = note.request_id
            if ok and self.reporter is not None:
                verdict = self.reporter.header_verdict(note, pod, reported)
                stream.headers[CACHE_HEADER] = verdict.header_value()
        tail = _StreamTail()
        try:
            sink = await open_stream(request, stream)
            if head and ok:
                # An engine streams nothing before its first token: this is the prefill's end.
                self.ledger.first_token(request_id, time.perf_counter())
                if self.on_first_token is not None:
                    self.on_first_token()
            if head:
                await sink.write(head)
                tail.add(head)
            async for chunk in chunks:
                await sink.write(chunk)
                tail.add(chunk)
        except (UpstreamError, TimeoutError) as exc:
            self.metrics.errors.labels("upstream").inc()
            logger.warning("stream from %s broke: %s", pod, exc)
            with contextlib.suppress(ConnectionResetError):
                await sink.write(b'data: {"error": {"message": "upstream endpoint failed mid-stream"}}\n\n')
            return stream
        except ConnectionResetError:
            return stream
        usage = self._record_stream_usage(tail.value())
        if note is not None and ok and self.reporter is not None:
            self.reporter.finish(note, pod, usage if usage is not None else reported)
        with contextlib.suppress(ConnectionResetError):
            await sink.write_eof()
        return stream

    def _record_usage(self, data: bytes) -> CacheUsage | None:
        try:
            body = _USAGE_DECODER.decode(data)
        except msgspec.DecodeError:  # not JSON, or not an object
            return None
        return self._count_cached(body.usage)

    def _record_stream_usage(self, tail: bytes) -> CacheUsage | None:
        for line in reversed(tail.split(b"\n")):
            if line.startswith(b"data: {") and b'"usage"' in line:
                try:
                    return self._count_cached(_USAGE_DECODER.decode(line[6:]).usage)
                except msgspec.DecodeError:
                    return None
        return None

    def _count_cached(self, raw_usage: Any) -> CacheUsage | None:
        usage = CacheUsage.from_usage(raw_usage)
        if usage is not None and usage.cached_tokens > 0:
            self.metrics.realized_hit_tokens.inc(usage.cached_tokens)
        return usage
