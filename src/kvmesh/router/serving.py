"""Serve the router's app until a signal; a worker sharing the port drains its clients first.

aiohttp's own shutdown closes every idle keep-alive connection at once. A client that has just
written its next request on one of them gets ``Server disconnected`` (HTTP/1.1 lets a server close
an idle connection at any time, and clients do not resend a POST), so each worker of a rolling
restart could fail a request under steady load. A worker of ``kvmesh router --workers N`` told to
stop with SIGTERM therefore drains: its listening socket closes (new connections go to the workers
sharing the port), every answer from then on says ``Connection: close``, and it waits up to
:data:`DRAIN_S` for its clients to leave the connections they hold (clients close idle pooled
connections after a while: aiohttp's after 15 s, httpx's after 5 s). Only then are the
connections still open closed and requests in flight waited for.

SIGINT stops at once (requests in flight still finish): the supervisor sends it when every worker
stops, and a lone router has nobody to drain its clients to.

``kvmesh router`` serves its port with the front (:mod:`kvmesh.router.front_server`), which drains
the same way, and the app behind it on a unix socket; ``--aiohttp-only`` serves the app on the port.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
from collections.abc import Mapping
from pathlib import Path

from aiohttp import hdrs, web

from kvmesh.router.front_http import HotHandler
from kvmesh.router.front_server import FrontServer

DRAIN_S = 20.0
"""Longest a draining worker waits for its clients to leave their connections."""
DRAIN_POLL_S = 0.1
SHUTDOWN_TIMEOUT_S = 60.0
"""Longest a request in flight may run on once the connections close (aiohttp's default)."""


async def serve_until_signalled(
    app: web.Application,
    host: str,
    port: int,
    *,
    reuse_port: bool,
    drain_s: float = 0.0,
    unix_path: str | None = None,
    front_routes: Mapping[str, HotHandler] | None = None,
    max_body_bytes: int = 0,
) -> None:
    """Serve ``app`` on ``host:port`` until SIGINT or SIGTERM; on SIGTERM, drain for up to
    ``drain_s`` first (see the module docstring). With ``unix_path``, also on that unix socket
    (a worker's own address for its peers, :mod:`kvmesh.router.worker_mesh`), which stays open
    while the shared port drains.

    With ``front_routes`` the port is the router's front (:mod:`kvmesh.router.front_server`):
    those ``POST`` routes are answered there (bodies up to ``max_body_bytes``), every other
    request is relayed to ``app`` on ``unix_path`` (a private one when ``None``)."""
    if front_routes is None:
        await _serve_on_aiohttp(app, host, port, reuse_port=reuse_port, drain_s=drain_s, unix_path=unix_path)
        return
    private_dir = None
    if unix_path is None:
        private_dir = tempfile.mkdtemp(prefix="kvmesh-router-")
        unix_path = str(Path(private_dir) / "app.sock")
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    front = FrontServer(front_routes, unix_path, max_body_bytes=max_body_bytes)
    try:
        await web.UnixSite(runner, unix_path).start()
        await front.start(host, port, reuse_port=reuse_port)
        if await _signalled() == signal.SIGTERM and drain_s > 0:
            await front.drain(drain_s)
        await front.aclose(SHUTDOWN_TIMEOUT_S)
    finally:
        await front.aclose(0)
        await runner.cleanup()
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)


async def _signalled() -> int:
    """Wait for SIGINT or SIGTERM; the one received."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[int] = loop.create_future()

    def on_signal(signum: int) -> None:
        if not received.done():
            received.set_result(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    return await received


async def _serve_on_aiohttp(
    app: web.Application, host: str, port: int, *, reuse_port: bool, drain_s: float, unix_path: str | None
) -> None:
    draining = False

    async def close_when_draining(request: web.Request, response: web.StreamResponse) -> None:
        if draining:
            # aiohttp has written its own Connection header before this hook runs: both are needed
            response.force_close()
            response.headers[hdrs.CONNECTION] = "close"

    app.on_response_prepare.append(close_when_draining)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
        await site.start()
        if unix_path is not None:
            await web.UnixSite(runner, unix_path).start()
        if await _signalled() == signal.SIGTERM and drain_s > 0:
            draining = True
            await site.stop()
            await _drain(runner, drain_s)
    finally:
        await runner.cleanup()


async def _drain(runner: web.AppRunner, drain_s: float) -> None:
    """Wait until no connection is open or ``drain_s`` passed."""
    server = runner.server
    if server is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + drain_s
    while server.connections and loop.time() < deadline:  # noqa: ASYNC110 (aiohttp has no event for it)
        await asyncio.sleep(DRAIN_POLL_S)
