"""One kept-alive HTTP/1.1 connection to an endpoint and the answer it carries.

:class:`UpstreamConnection` is the asyncio protocol: it writes one request at a time and feeds the
answer, parsed by llhttp (``httptools``), to an :class:`UpstreamResponse`, which hands out the body
whole or chunk by chunk and stops reading the socket while a slow reader leaves too much unread.
The pool of connections is :mod:`kvmesh.router.upstream_http`.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Protocol

import httptools

from kvmesh.errors import UpstreamError, UpstreamUnreachableError

_PAUSE_AT = 256 * 1024
"""Bytes of an answer buffered unread before the socket stops being read (a slow client)."""


class ConnectionOwner(Protocol):
    """The pool a connection returns to."""

    loop: asyncio.AbstractEventLoop

    def put_idle(self, conn: UpstreamConnection) -> None:
        """``conn`` finished a request and may carry another."""

    def forget(self, conn: UpstreamConnection) -> None:
        """``conn`` closed."""


class UpstreamResponse:
    """An endpoint's answer: status and headers at once, the body as it arrives.

    Call :meth:`release` when done with it (after the body, or to abandon it): a fully read answer
    returns its connection to the pool, anything else closes the connection.
    """

    __slots__ = ("_buffered", "_chunks", "_conn", "_done", "_error", "_waiter", "_whole", "headers", "status")

    def __init__(self, conn: UpstreamConnection) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        """Header names lowercased; a repeated header keeps its last value."""
        self._conn: UpstreamConnection | None = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._whole = False
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    async def read(self) -> bytes:
        """The whole body.

        Raises:
            UpstreamError: the answer broke before its end.
            TimeoutError: the request's deadline passed.
        """
        self._whole = True  # all of it is wanted: never stop reading the socket for it
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        while not self._done:
            if self._error is not None:
                raise self._error
            await self._wait()
        if self._error is not None:
            raise self._error
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return data

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked encoding removed): what arrived since the last piece,
        in one piece (a relay behind on a fast stream writes once, not once per arrival).

        Raises:
            UpstreamError: the answer broke before its end.
            TimeoutError: the request's deadline passed.
        """
        while True:
            if self._chunks:
                chunks = self._chunks
                chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                conn = self._conn
                if conn is not None and conn.paused:
                    conn.resume()
                yield chunk
            elif self._error is not None:
                raise self._error
            elif self._done:
                return
            else:
                await self._wait()

    def release(self) -> None:
        """Give the connection back (kept alive when the answer was read to its end) or close it."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish(reuse=self._done and self._error is None and not self._chunks)

    async def _wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # Fed by the connection's parser callbacks.

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        conn = self._conn
        if conn is not None and self._buffered > _PAUSE_AT and not self._whole and not conn.paused:
            conn.pause()
        self._wake()

    def _end(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if not self._done and self._error is None:
            self._error = error
        self._wake()


class UpstreamConnection(asyncio.Protocol):
    """One kept-alive connection to an endpoint; at most one request on it at a time."""

    def __init__(self, owner: ConnectionOwner) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.headers_ready: asyncio.Future[None] | None = None
        self.answered = False
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        self._pending_headers: list[tuple[bytes, bytes]] = []
        self._framed = False
        self._keep_alive = True
        self._timer: asyncio.TimerHandle | None = None

    def send(self, data: bytes, deadline: float) -> UpstreamResponse:
        """Write a request and return its (not yet started) answer; fails it at ``deadline``."""
        assert self.response is None and self.transport is not None, (
            "a connection carries one request at a time"
        )
        response = self.response = UpstreamResponse(self)
        loop = self.owner.loop
        self.headers_ready = loop.create_future()
        self.answered = False
        self._framed = False
        self._timer = loop.call_at(deadline, self._time_out)
        self.transport.write(data)
        return response

    def finish(self, *, reuse: bool) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.response = None
        ready, self.headers_ready = self.headers_ready, None
        if ready is not None:
            if not ready.done():
                ready.cancel()
            elif not ready.cancelled():
                ready.exception()  # seen: an abandoned request's failure is not an unretrieved one
        if reuse and self._keep_alive and not self.closed:
            if self.paused:
                self.resume()
            self.owner.put_idle(self)
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self._closed()

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def _closed(self) -> None:
        if not self.closed:
            self.closed = True
            self.owner.forget(self)

    def _fail(self, error: BaseException) -> None:
        ready = self.headers_ready
        if ready is not None and not ready.done():
            ready.set_exception(error)
        if self.response is not None:
            self.response._fail(error)

    def _time_out(self) -> None:
        self._timer = None
        self._fail(TimeoutError("endpoint did not answer in time"))
        self.close()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing asked: an endpoint talking out of turn
            self.close()
            return
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed HTTP answer: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed()
        response = self.response
        if response is None or response._done:
            return
        ready = self.headers_ready
        if ready is not None and ready.done() and not ready.exception() and not self._framed:
            response._end()  # a body without length or chunks ends when the connection does
        elif not self.answered:
            self._fail(UpstreamUnreachableError(f"connection closed before an answer ({exc or 'EOF'})"))
        else:
            self._fail(UpstreamError(f"connection closed mid-answer ({exc or 'EOF'})"))

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._pending_headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        pending, self._pending_headers = self._pending_headers, []
        if status < 200:  # an interim answer (100 Continue): the real one follows
            return
        response = self.response
        assert response is not None
        response.status = status
        headers = response.headers
        for name, value in pending:
            key = name.decode("utf-8", "surrogateescape").lower()
            if key == "content-length" or key == "transfer-encoding":
                self._framed = True
            headers[key] = value.decode("utf-8", "surrogateescape")
        self._keep_alive = self.parser.should_keep_alive()
        ready = self.headers_ready
        if ready is not None and not ready.done():
            ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        if self.response is not None and self.response.status >= 200:
            self._framed = True
            self.response._end()
