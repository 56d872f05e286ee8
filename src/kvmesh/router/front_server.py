"""The router's front: its port, the completion routes served there, every other route relayed.

``kvmesh router`` listens with :class:`FrontServer`: the ``POST`` routes that carry inference
traffic are answered by the gateway's handlers on :class:`~kvmesh.router.front_http.FrontConnection`
(no aiohttp request or response machinery per request); everything else (admin API, ``/metrics``,
``/health``, ``/v1/models``, prewarm, the pools' own prefixes) goes through :class:`AppRelay` to
the aiohttp app, served on a unix socket of the same process, and answers exactly as it did.
``kvmesh router --aiohttp-only`` serves the app on the port instead.

Idle kept-alive connections are closed after :data:`KEEPALIVE_S` (aiohttp's default). Draining
(a worker told to stop in a rolling restart, :mod:`kvmesh.router.serving`) stops listening and
makes every answer from then on close its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping

import aiohttp
from multidict import CIMultiDict

from kvmesh.router.front_http import FrontConnection, FrontRequest, HotHandler
from kvmesh.router.worker_mesh import LOCAL_HEADER

KEEPALIVE_S = 75.0
"""An idle kept-alive connection is closed after this long."""
SWEEP_S = 5.0
"""How often idle connections are looked for."""
LISTEN_BACKLOG = 1024
_REQUEST_HOP_BY_HOP = frozenset(
    (
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "expect",
        "te",
        "upgrade",
        "proxy-connection",
        LOCAL_HEADER,  # the workers' own: a client cannot make one worker answer alone
    )
)
_ANSWER_HOP_BY_HOP = frozenset(("connection", "keep-alive", "transfer-encoding", "content-length", "date"))
"""Headers of the app's answer the front writes itself."""


class AppRelay:
    """Sends requests the front does not serve to the aiohttp app's unix socket, answers back.

    Args:
        socket_path: where the app is served.
    """

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._session: aiohttp.ClientSession | None = None

    async def relay(self, request: FrontRequest, conn: FrontConnection) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path, limit=0),
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
            )
        headers = CIMultiDict(
            (k, v) for k, v in request.headers.items() if k.lower() not in _REQUEST_HOP_BY_HOP
        )
        head_sent = False
        try:
            async with self._session.request(
                request.method,
                f"http://kvmesh-app{request.target}",
                headers=headers,
                data=request.body or None,
                allow_redirects=False,
            ) as answer:
                out = CIMultiDict(
                    (k, v) for k, v in answer.headers.items() if k.lower() not in _ANSWER_HOP_BY_HOP
                )
                length = answer.headers.get("content-length")
                if request.method == "HEAD":
                    size = int(length) if length is not None and length.isdigit() else 0
                    conn.write(request.head(answer.status, answer.reason, out, size))
                elif length is not None:
                    body = await answer.read()
                    conn.write(request.head(answer.status, answer.reason, out, len(body)) + body)
                else:
                    stream = request.start_stream(answer.status, answer.reason, out)
                    head_sent = True
                    async for chunk in answer.content.iter_any():
                        await stream.write(chunk)
                    await stream.write_eof()
        except (aiohttp.ClientError, TimeoutError, ConnectionResetError) as exc:
            if head_sent:
                request.keep_alive = False  # the answer broke off: the client sees the connection close
            else:
                conn.write_json(request, 502, f"the router's app did not answer: {exc}", "upstream_error")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class FrontServer:
    """Listens on the router's port (see the module docstring).

    Args:
        routes: the gateway's handlers of the ``POST`` routes served on the front, by path.
        app_socket: the unix socket the aiohttp app is served on (every other route).
        max_body_bytes: largest request body.
        keepalive_s: idle time after which a kept-alive connection is closed.
    """

    def __init__(
        self,
        routes: Mapping[str, HotHandler],
        app_socket: str,
        *,
        max_body_bytes: int,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self.routes = dict(routes)
        self.relay = AppRelay(app_socket)
        self.max_body_bytes = max_body_bytes
        self.keepalive_s = keepalive_s
        self.connections: set[FrontConnection] = set()
        self.draining = False
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._connection, host, port, reuse_port=reuse_port or None, backlog=LISTEN_BACKLOG
        )
        self._sweeper = loop.create_task(self._sweep())

    @property
    def port(self) -> int:
        """The port listened on (the one given, or the one the OS chose for 0)."""
        assert self._server is not None and self._server.sockets, "FrontServer.start() first"  # type: ignore[attr-defined]
        return int(self._server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    def _connection(self) -> FrontConnection:
        conn = FrontConnection(
            self.routes,
            self.relay,
            max_body_bytes=self.max_body_bytes,
            on_open=self.connections.add,
            on_close=self.connections.discard,
        )
        conn.draining = self.draining
        return conn

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            idle_since = time.monotonic() - self.keepalive_s
            for conn in [c for c in self.connections if c.last_active < idle_since]:
                conn.close_if_idle(partial_too=True)  # a request that stalled that long is dropped too

    def stop_listening(self) -> None:
        """New connections are refused (those open are served on)."""
        if self._server is not None:
            self._server.close()

    async def drain(self, drain_s: float, poll_s: float = 0.1) -> None:
        """Stop listening; every answer from now on closes its connection; return once no
        connection is open or ``drain_s`` passed."""
        self.stop_listening()
        self.draining = True
        for conn in self.connections:
            conn.draining = True
        deadline = time.monotonic() + drain_s
        while self.connections and time.monotonic() < deadline:  # noqa: ASYNC110 (connections close one by one)
            await asyncio.sleep(poll_s)

    async def aclose(self, timeout_s: float, poll_s: float = 0.05) -> None:
        """Close idle connections at once, the others once their request is answered (at most
        ``timeout_s``), then everything."""
        self.stop_listening()
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.connections and time.monotonic() < deadline:
            for conn in list(self.connections):
                conn.draining = True
                conn.close_if_idle()
            if self.connections:
                await asyncio.sleep(poll_s)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.relay.aclose()
