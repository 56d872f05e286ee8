"""Router test fixtures: test engines and a real redis-server on an ephemeral port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from typing import Any

import pytest
from front_testing import SERVING
from router_fakes import FakeEngine, free_port


@pytest.fixture
async def engines():
    started: list[FakeEngine] = []

    async def make(n: int, **kwargs: Any) -> list[FakeEngine]:
        out = [await FakeEngine(f"e{len(started) + i}", **kwargs).start() for i in range(n)]
        started.extend(out)
        return out

    yield make
    for e in started:
        await e.stop()


@pytest.fixture(scope="session")
def redis_url():
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed (run scripts/system-deps.sh)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(params=["aiohttp", "front"])
def both_servers(request):
    """Runs a test with its routers on aiohttp alone and behind the router's front (opt in with
    ``pytestmark = pytest.mark.usefixtures("both_servers")``; servers made with ``served``)."""
    SERVING.front = request.param == "front"
    yield request.param
    SERVING.front = False
