"""HTTP/1.1 from the router to its endpoints on asyncio protocols: the request path's client.

Every routed request is one POST to an endpoint and its answer relayed back. aiohttp's client was
the larger part of a bare aiohttp relay's CPU per request (``benchmarks/router_cpu_profile.py
--passthrough``: the relay 0.435 ms, with this client instead 0.267 ms); this client writes the
request head itself, parses the answer with llhttp (``httptools``) and keeps connections alive per
endpoint. It does only what the router needs: POST with a body, the answer's status
and headers, its body whole (:meth:`UpstreamResponse.read`) or chunk by chunk as it arrives
(:meth:`UpstreamResponse.iter_chunks`, for SSE), one deadline per request, a bound on connections
per endpoint.

Failures come in two kinds (:mod:`kvmesh.errors`): :class:`UpstreamUnreachableError` when no
answer began (connect refused or timed out, or the connection closed before the first byte of a
response: nothing was generated, so another endpoint may take the request), and
:class:`UpstreamError` for an answer that broke after it began. ``TimeoutError`` when the
request's deadline passes. A kept-alive connection the endpoint closed just as it was reused is
retried once on a new connection, never counted as the endpoint being down.

::

    UpstreamClient ── one _Host per origin ── idle UpstreamConnections (oldest first), waiters
         post() ──► UpstreamConnection.send(head + body) ──► UpstreamResponse (status, headers, chunks)
                                     release() ──► back to the idle list, or closed
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvmesh.errors import UpstreamUnreachableError
from kvmesh.router.upstream_connection import UpstreamConnection, UpstreamResponse


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an endpoint URL's requests go: host, port, TLS, and the path prefix of its routes."""

    host: str
    port: int
    tls: bool
    base_path: str
    host_header: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        """The origin of ``url`` (``http://host:port[/prefix]`` or ``https://...``).

        Raises:
            ValueError: not an http(s) URL with a host.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoint URL must be http(s)://host[:port][/path], got {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        netloc = parts.netloc.rpartition("@")[2]
        return cls(parts.hostname, port, tls, parts.path.rstrip("/"), netloc)


class _Host:
    """The connections to one origin: the idle ones oldest first, and requests waiting for one."""

    def __init__(self, client: UpstreamClient, endpoint: str, origin: Origin) -> None:
        self.client = client
        self.endpoint = endpoint
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.idle: collections.deque[UpstreamConnection] = collections.deque()
        self.num_open = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._sweep: asyncio.TimerHandle | None = None
        self.heads: dict[str, bytes] = {}
        """Each route's request line and Host header, encoded once."""

    async def acquire(self, deadline: float) -> tuple[UpstreamConnection, bool]:
        """A connection for one request and whether it was kept alive from an earlier one."""
        client = self.client
        while True:
            idle = self.idle
            while idle:
                conn = idle.popleft()
                if not conn.closed and self.loop.time() - conn.idle_since < client.keepalive_s:
                    return conn, True
                conn.close()
            if self.num_open < client.max_connections:
                return await self._open(deadline), False
            waiter = self.loop.create_future()
            self.waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException:
                if not waiter.done():
                    waiter.cancel()
                elif not waiter.cancelled():
                    self._wake_one()  # woken but leaving: the free slot goes to the next waiter
                raise

    async def _open(self, deadline: float) -> UpstreamConnection:
        origin = self.origin
        self.num_open += 1
        conn = UpstreamConnection(self)
        try:
            async with asyncio.timeout_at(min(deadline, self.loop.time() + self.client.connect_timeout_s)):
                await self.loop.create_connection(
                    lambda: conn,
                    origin.host,
                    origin.port,
                    ssl=self.client.tls_context() if origin.tls else None,
                    server_hostname=origin.host if origin.tls else None,
                )
        except (OSError, TimeoutError) as exc:
            conn.close()
            what = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            raise UpstreamUnreachableError(f"cannot connect to {origin.host}:{origin.port}: {what}") from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def put_idle(self, conn: UpstreamConnection) -> None:
        conn.idle_since = self.loop.time()
        self.idle.append(conn)
        self._wake_one()
        if self._sweep is None:
            self._sweep = self.loop.call_later(self.client.keepalive_s, self._close_expired)

    def forget(self, conn: UpstreamConnection) -> None:
        """``conn`` closed: its slot is free."""
        if conn in self.idle:
            self.idle.remove(conn)
        self._release_slot()

    def close_all(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        while self.idle:
            self.idle.popleft().close()

    def _release_slot(self) -> None:
        self.num_open -= 1
        self._wake_one()
        if self.num_open == 0 and self._sweep is None:
            # Unused for keepaliveS from now on, the host is dropped (pods come and go).
            self._sweep = self.loop.call_later(self.client.keepalive_s, self._close_expired)

    def _wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _close_expired(self) -> None:
        self._sweep = None
        cutoff = self.loop.time() - self.client.keepalive_s
        while self.idle and self.idle[0].idle_since <= cutoff:
            self.idle.popleft().close()
        if self._sweep is not None:  # the last close asked for a sweep: this is it
            self._sweep.cancel()
            self._sweep = None
        if self.idle:
            wait = self.idle[0].idle_since + self.client.keepalive_s - self.loop.time()
            self._sweep = self.loop.call_later(max(wait, 0.01), self._close_expired)
        elif self.num_open == 0 and not self.waiters:
            self.client.drop_host(self)


class UpstreamClient:
    """POSTs to endpoints over kept-alive HTTP/1.1 connections.

    Args:
        max_connections_per_endpoint: connections open to one endpoint, busy or idle; a request
            that finds them all busy waits for one (within its deadline).
        keepalive_s: an idle connection is closed after this long.
        connect_timeout_s: opening a connection may take this long (then the endpoint counts as
            unreachable for this request).
    """

    def __init__(
        self,
        *,
        max_connections_per_endpoint: int = 1024,
        keepalive_s: float = 15.0,
        connect_timeout_s: float = 2.0,
    ) -> None:
        if max_connections_per_endpoint < 1:
            raise ValueError(f"max_connections_per_endpoint must be >= 1, got {max_connections_per_endpoint}")
        self.max_connections = max_connections_per_endpoint
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self._hosts: dict[str, _Host] = {}
        self._tls: ssl.SSLContext | None = None

    async def post(
        self, endpoint: str, path: str, body: bytes, headers: Mapping[str, str], *, timeout_s: float
    ) -> UpstreamResponse:
        """Send ``body`` to ``endpoint`` + ``path`` and return the answer once its headers are in.

        Args:
            endpoint: the endpoint's URL (``http://host:port``, optionally with a path prefix).
            path: the route, already percent-encoded (``/v1/completions``).
            body: the request body.
            headers: request headers (``Host``, ``Content-Length`` and ``Connection`` are the
                client's own).
            timeout_s: the whole request's deadline, body included.

        Returns:
            The answer; :meth:`UpstreamResponse.release` it when done.

        Raises:
            UpstreamUnreachableError: no answer began; another endpoint may take the request.
            UpstreamError: the answer broke or was not HTTP.
            TimeoutError: ``timeout_s`` passed first.
            ValueError: ``endpoint`` is not an http(s) URL, or a header holds a line break.
        """
        host = self._hosts.get(endpoint)
        if host is None:
            host = self._hosts[endpoint] = _Host(self, endpoint, Origin.parse(endpoint))
        head = host.heads.get(path)
        if head is None:
            head = host.heads[path] = _request_head(host.origin, path)
        data = head + _header_lines(headers, len(body)) + body
        deadline = host.loop.time() + timeout_s
        for attempt in (1, 2):
            conn, reused = await host.acquire(deadline)
            response = conn.send(data, deadline)
            ready = conn.headers_ready
            assert ready is not None
            try:
                await ready
            except UpstreamUnreachableError:
                response.release()
                if reused and attempt == 1:
                    continue  # the endpoint closed a kept-alive connection as it was reused
                raise
            except BaseException:
                response.release()
                raise
            return response
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def aclose(self) -> None:
        """Close every idle connection (answers still being read keep theirs until released)."""
        for host in self._hosts.values():
            host.close_all()
        self._hosts.clear()

    def num_open(self, endpoint: str) -> int:
        """Connections open to ``endpoint``, busy or idle."""
        host = self._hosts.get(endpoint)
        return 0 if host is None else host.num_open

    def tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def drop_host(self, host: _Host) -> None:
        """``host`` has had no connection for ``keepalive_s``: forget it (a new request starts anew)."""
        if self._hosts.get(host.endpoint) is host:
            del self._hosts[host.endpoint]

    def connection_counts(self) -> dict[str, tuple[int, int, int]]:
        """Per endpoint: connections busy (opening included), connections idle, requests waiting for one."""
        return {
            endpoint: (
                host.num_open - len(host.idle),
                len(host.idle),
                sum(not w.done() for w in host.waiters),
            )
            for endpoint, host in self._hosts.items()
        }

    def num_hosts(self) -> int:
        """Endpoints with connections open or closed less than ``keepalive_s`` ago."""
        return len(self._hosts)


def _request_head(origin: Origin, path: str) -> bytes:
    if any(c in path for c in " \r\n"):
        raise ValueError(f"request path must be percent-encoded, got {path!r}")
    return f"POST {origin.base_path}{path} HTTP/1.1\r\nHost: {origin.host_header}\r\n".encode()


_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
"""Request headers the client writes itself (the caller's are dropped)."""


def _header_lines(headers: Mapping[str, str], length: int) -> bytes:
    lines = [f"{name}: {value}\r\n" for name, value in headers.items() if name.lower() not in _OWN_HEADERS]
    text = "".join(lines)
    if text.count("\n") != len(lines) or text.count("\r") != len(lines):
        raise ValueError("a request header holds a line break")
    # surrogateescape: header bytes that are not UTF-8 go out as they came in
    return f"{text}Content-Length: {length}\r\n\r\n".encode("utf-8", "surrogateescape")
