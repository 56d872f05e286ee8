"""One client connection to the router's front: HTTP/1.1 parsed by llhttp, answers written back.

aiohttp's server costs about 0.13 ms of CPU per request more than an asyncio protocol does
(docs/benchmarks/router.md, "The router's own client to the endpoints, and the Python floor"), a
fifth of what the router spends on a short request. The front (:mod:`kvmesh.router.front_server`)
therefore serves the completion routes itself: :class:`FrontConnection` parses each request with
llhttp (``httptools``), hands a :class:`FrontRequest` to the gateway's handler and writes the
``web.Response`` it returns (or the stream it opened, chunk by chunk). Every other request is
passed to the server's relay, which sends it on to the aiohttp app unchanged.

Requests on one connection are answered in order (pipelined ones wait their turn). A body larger
than the limit is a 413 and the connection closes; a malformed request is a 400 and the connection
closes; ``Expect: 100-continue`` is answered before the body is read.
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import http
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import httptools
from aiohttp import web
from multidict import CIMultiDict

from kvmesh.core.agent_apis import PromptApi
from kvmesh.router.agent_routes import api_error_body, api_of_path
from kvmesh.router.client_request import StreamSink

logger = logging.getLogger(__name__)

MAX_LINE_BYTES = 8190
"""Longest request target, and longest header (name and value), as aiohttp's server allows: 414, 431."""
MAX_HEAD_BYTES = 64 * 1024
"""Longest request line and headers together (a longer head is a 431)."""
_HOP_BY_HOP = frozenset(("connection", "content-length", "transfer-encoding", "keep-alive"))
"""Headers of a handler's answer the front writes itself."""

HotHandler = Callable[["FrontRequest"], Awaitable[web.StreamResponse]]


class Relay(Protocol):
    """Where requests for routes the front does not serve go."""

    async def relay(self, request: FrontRequest, conn: FrontConnection) -> None:
        """Answer ``request`` on ``conn`` (through :meth:`FrontConnection.write_head` and writes)."""


class FrontRequest:
    """A client's request to the front (see :class:`kvmesh.router.client_request.ClientRequest`)."""

    __slots__ = ("_conn", "body", "headers", "http10", "keep_alive", "method", "path", "query", "streamed")

    def __init__(
        self,
        conn: FrontConnection,
        method: str,
        target: str,
        headers: CIMultiDict[str],
        body: bytes,
        keep_alive: bool,
        http10: bool = False,
    ) -> None:
        self._conn = conn
        self.method = method
        self.path, self.query = split_target(target)
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http10 = http10
        """An HTTP/1.0 request: its answers are not chunked, and kept alive only when it asked."""
        self.streamed: FrontStream | None = None
        """The stream a handler opened (its answer was sent as it went)."""

    @property
    def transport(self) -> asyncio.BaseTransport | None:
        return self._conn.transport

    @property
    def target(self) -> str:
        """The path with its query, as the client sent it."""
        return f"{self.path}?{self.query}" if self.query else self.path

    async def read(self) -> bytes:
        return self.body

    async def open_stream(self, response: web.StreamResponse) -> StreamSink:
        self.streamed = self.start_stream(response.status, response.reason, response.headers)
        return self.streamed

    def start_stream(self, status: int, reason: str | None, headers: Mapping[str, str]) -> FrontStream:
        """Write the head of an answer whose body follows as it comes: chunked, or for an
        HTTP/1.0 client unframed and ended by closing the connection."""
        if self.http10:
            self.keep_alive = False
        self._conn.write(self.head(status, reason, headers, None))
        return FrontStream(self._conn, chunked=not self.http10)

    def head(self, status: int, reason: str | None, headers: Mapping[str, str], length: int | None) -> bytes:
        """The head of this request's answer (see :meth:`FrontConnection.head`)."""
        return self._conn.head(status, reason, headers, length, self.keep_alive, http10=self.http10)


def split_target(target: str) -> tuple[str, str]:
    """A request target's path and query."""
    if target.startswith("/"):
        path, _, query = target.partition("?")
        return path, query
    parts = urllib.parse.urlsplit(target)  # absolute form (a client talking to a proxy), or "*"
    return parts.path or target, parts.query


class FrontStream:
    """A streamed answer's body, sent with chunked transfer encoding (``chunked``) or as it is
    (to an HTTP/1.0 client, the connection closed after)."""

    __slots__ = ("_conn", "chunked", "ended")

    def __init__(self, conn: FrontConnection, *, chunked: bool = True) -> None:
        self._conn = conn
        self.chunked = chunked
        self.ended = False

    async def write(self, data: bytes) -> None:
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("the client closed the connection")
        if data:
            conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
            if conn.writing_paused:
                await conn.drained()

    async def write_eof(self, data: bytes = b"") -> None:
        if self.ended:
            return
        if data:
            await self.write(data)
        self.ended = True
        if self.chunked and not self._conn.closed:
            self._conn.write(b"0\r\n\r\n")


class _DateHeader:
    """``Date: …`` for answers, formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._line = b""

    def line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = f"Date: {email.utils.formatdate(now, usegmt=True)}\r\n".encode("latin-1")
        return self._line


DATE = _DateHeader()


class FrontConnection(asyncio.Protocol):
    """One client connection (see the module docstring).

    Args:
        routes: handlers by path of the ``POST`` routes served here.
        relay: answers every other request.
        max_body_bytes: largest request body.
        on_open: called with this connection once it opened.
        on_close: called with this connection once it closed.
    """

    def __init__(
        self,
        routes: Mapping[str, HotHandler],
        relay: Relay,
        *,
        max_body_bytes: int,
        on_open: Callable[[FrontConnection], None],
        on_close: Callable[[FrontConnection], None],
    ) -> None:
        self.routes = routes
        self.relay = relay
        self.max_body_bytes = max_body_bytes
        self._on_open = on_open
        self._on_close = on_close
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.draining = False
        """Set by the server: every answer from now on closes its connection."""
        self.writing_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._parser = httptools.HttpRequestParser(self)
        self._target = bytearray()
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._in_message = False
        self._queue: collections.deque[FrontRequest] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._refused = False
        self._reading_paused = False
        self.last_active = time.monotonic()

    # ------------------------------------------------------------------ asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport
        self._on_open(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake_writers()
        self._on_close(self)

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake_writers()

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self._refused:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not served here")
        except httptools.HttpParserError as exc:
            if not self._refused:
                self._refuse(400, f"malformed HTTP request: {exc}")

    # ------------------------------------------------------------------ llhttp callbacks

    def on_message_begin(self) -> None:
        self._in_message = True
        self._target.clear()
        self._raw_headers = []
        self._head_bytes = 0
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._target += url
        self._head_bytes += len(url)
        if len(self._target) > MAX_LINE_BYTES:
            self._refuse(414, f"request target longer than {MAX_LINE_BYTES} bytes")
            raise httptools.HttpParserError("target too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value)
        if size > MAX_LINE_BYTES:
            self._refuse(431, f"header {name[:64].decode('latin-1')!r} longer than {MAX_LINE_BYTES} bytes")
            raise httptools.HttpParserError("header too long")
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, f"request line and headers longer than {MAX_HEAD_BYTES} bytes")
            raise httptools.HttpParserError("head too long")
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        # one multidict built from all the pairs (in C) instead of one add per header
        self._headers = CIMultiDict(
            [(n.decode("latin-1"), v.decode("latin-1")) for n, v in self._raw_headers]
        )
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            self._refuse(413, f"request body larger than {self.max_body_bytes} bytes")
            raise httptools.HttpParserError("body too large")
        if self._headers.get("expect", "").lower() == "100-continue" and self._task is None:
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.max_body_bytes:
            self._refuse(413, f"request body larger than {self.max_body_bytes} bytes")
            raise httptools.HttpParserError("body too large")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        parser = self._parser
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = FrontRequest(
            self,
            parser.get_method().decode("latin-1"),
            self._target.decode("latin-1"),
            self._headers,
            body,
            parser.should_keep_alive(),
            parser.get_http_version() == "1.0",
        )
        self._queue.append(request)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._answer_queued())
        elif len(self._queue) > 8 and self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()  # a client pipelining far ahead waits for its answers

    # ------------------------------------------------------------------ answering

    async def _answer_queued(self) -> None:
        try:
            while self._queue and not self.closed:
                request = self._queue.popleft()
                if not request.keep_alive or self.draining:
                    request.keep_alive = False
                await self._answer(request)
                if not request.keep_alive:
                    self.close()
                    return
                if self._reading_paused and len(self._queue) <= 8 and self.transport is not None:
                    self._reading_paused = False
                    self.transport.resume_reading()
        finally:
            self._task = None
            self.last_active = time.monotonic()

    async def _answer(self, request: FrontRequest) -> None:
        handler = self.routes.get(request.path) if request.method == "POST" else None
        if handler is None:
            await self.relay.relay(request, self)
            return
        try:
            response = await handler(request)
        except Exception:
            logger.exception("unhandled error answering %s %s", request.method, request.path)
            if request.streamed is None:
                self.write_json(request, 500, "internal error in the router", "server_error")
            else:
                request.keep_alive = False
            return
        stream = request.streamed
        if stream is not None:
            await stream.write_eof()
            return
        body = response.body if isinstance(response, web.Response) else b""
        if not isinstance(body, bytes | bytearray):
            logger.error("a handler answered %s with a body of type %s", request.path, type(body).__name__)
            self.write_json(request, 500, "internal error in the router", "server_error")
            return
        self.write(request.head(response.status, response.reason, response.headers, len(body)) + body)

    def write_json(self, request: FrontRequest, status: int, message: str, kind: str) -> None:
        """Answer ``request`` with an error in the shape its API's clients parse."""
        self.write(
            self._error_answer(request.path, status, message, kind, request.keep_alive, request.http10)
        )

    def _error_answer(
        self, path: str, status: int, message: str, kind: str, keep_alive: bool, http10: bool = False
    ) -> bytes:
        """An error in the shape the clients of ``path``'s API parse (Anthropic's on
        ``/v1/messages``, whose kinds follow the status; OpenAI's elsewhere)."""
        api = api_of_path(path)
        body = api_error_body(api, status, message, kind=None if api is PromptApi.MESSAGES else kind)
        head = self.head(
            status, None, {"Content-Type": "application/json"}, len(body), keep_alive, http10=http10
        )
        return head + body

    def head(
        self,
        status: int,
        reason: str | None,
        headers: Mapping[str, str],
        length: int | None,
        keep_alive: bool,
        *,
        http10: bool = False,
    ) -> bytes:
        """The status line and headers of an answer (``length`` ``None``: a chunked body, or for
        an HTTP/1.0 client, ``http10``, a body ended by closing the connection)."""
        if reason is None:
            try:
                reason = http.HTTPStatus(status).phrase
            except ValueError:
                reason = ""
        lines = [f"HTTP/1.1 {status} {reason}\r\n"]
        lines.extend(f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() not in _HOP_BY_HOP)
        if length is not None:
            lines.append(f"Content-Length: {length}\r\n")
        elif not http10:
            lines.append("Transfer-Encoding: chunked\r\n")
        if not keep_alive or self.draining:
            lines.append("Connection: close\r\n")
        elif http10:
            lines.append("Connection: keep-alive\r\n")  # an HTTP/1.0 client closes unless told
        return "".join(lines).encode("latin-1") + DATE.line() + b"\r\n"

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    async def drained(self) -> None:
        """Return once the transport takes writes again (or the connection closed)."""
        if not self.writing_paused or self.closed:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def _wake_writers(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` once the requests before are answered, then close."""
        if self._refused:
            return
        self._refused = True
        path = split_target(self._target.decode("latin-1"))[0] if self._in_message else ""
        answer = self._error_answer(path, status, message, "invalid_request_error", False)
        if self._task is None:
            self.write(answer)
            self.close()
            return

        async def after_queued(task: asyncio.Task[None]) -> None:
            await task
            self.write(answer)
            self.close()

        self._queue.clear()
        asyncio.get_running_loop().create_task(after_queued(self._task))

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    def close_if_idle(self, *, partial_too: bool = False) -> bool:
        """Close the connection unless a request is being answered or (unless ``partial_too``:
        one that sent nothing for the keep-alive time) being received; whether it was closed."""
        if self._task is not None or (self._in_message and not partial_too):
            return False
        self.close()
        return True
