"""An aiohttp test server that serves an app the way ``kvmesh router`` does: behind the front."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer
from yarl import URL

from kvmesh.router.front_http import HotHandler
from kvmesh.router.front_server import FrontServer


class FrontTestServer(TestServer):
    """``app`` on a unix socket behind a :class:`FrontServer` on an ephemeral loopback port that
    answers ``routes`` itself (for ``aiohttp.test_utils.TestClient``)."""

    def __init__(
        self,
        app: web.Application,
        routes: Mapping[str, HotHandler],
        *,
        max_body_bytes: int = 2**20,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self.routes = routes
        self.max_body_bytes = max_body_bytes
        self.front: FrontServer | None = None
        self._dir: str | None = None

    async def start_server(self, loop: Any = None, **kwargs: Any) -> None:
        if self.runner:
            return
        self._dir = tempfile.mkdtemp(prefix="kvmesh-front-test-")
        socket_path = str(Path(self._dir) / "app.sock")
        self.runner = await self._make_runner(**kwargs)
        await self.runner.setup()
        await web.UnixSite(self.runner, socket_path).start()
        self.front = FrontServer(self.routes, socket_path, max_body_bytes=self.max_body_bytes)
        await self.front.start(self.host, 0)
        self.port = self.front.port
        self.scheme = "http"
        self._root = URL(f"http://{self.host}:{self.port}")

    async def close(self) -> None:
        if self.front is not None:
            await self.front.aclose(5.0)
            self.front = None
        await super().close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class _Serving:
    front = False
    """Set by the ``both_servers`` fixture: :func:`served` puts the router behind the front."""


SERVING = _Serving()


def served(router: Any) -> TestServer:
    """A test server of ``router`` (a ``Gateway`` or ``PooledRouter``): on aiohttp alone, or, under
    the ``both_servers`` fixture's ``front`` run, as ``kvmesh router`` serves it."""
    if not SERVING.front:
        return TestServer(router.app)
    return FrontTestServer(router.app, router.front_routes(), max_body_bytes=router.config.max_body_bytes)
