"""What ``kvmesh router --workers N``'s worker mesh adds to each proxied request, in process.

    .venv/bin/python benchmarks/router_worker_mesh_cost.py [--requests 20000] [--rounds 5]

The mesh (:mod:`kvmesh.router.worker_mesh`) is an aiohttp middleware on every worker: each request
passes through it (a header lookup and a few string tests) before the gateway's handler. This runs
aiohttp's own dispatch (``Application._handle``: route match, middleware chain, handler) on
mocked ``POST /v1/completions`` requests to a handler that answers at once, with and without the
mesh installed, alternating rounds, and prints CPU µs per request of each and the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from kvmesh.router.worker_mesh import WorkerMesh


async def _answer(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def _app(with_mesh: bool, directory: str) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", _answer)
    app.router.add_get("/metrics", _answer)
    if with_mesh:
        WorkerMesh(0, 2, directory, admin_token=None, configured={"": []}).install(app)
    app.freeze()
    return app


async def _cpu_us_per_request(app: web.Application, requests: int) -> float:
    headers = {"Content-Type": "application/json", "Authorization": "Bearer x"}
    batch = [
        make_mocked_request("POST", "/v1/completions", headers=headers, app=app) for _ in range(requests)
    ]
    start = time.process_time()
    for request in batch:
        await app._handle(request)
    return (time.process_time() - start) / requests * 1e6


async def main(args: Any) -> None:
    with tempfile.TemporaryDirectory() as directory:
        apps = {"without mesh": _app(False, directory), "with mesh": _app(True, directory)}
        figures: dict[str, list[float]] = {name: [] for name in apps}
        for _ in range(args.rounds):
            for name, app in apps.items():
                figures[name].append(await _cpu_us_per_request(app, args.requests))
    for name, values in figures.items():
        print(f"{name}: {statistics.median(values):.2f} µs CPU per request (median of {args.rounds})")
    added = statistics.median(figures["with mesh"]) - statistics.median(figures["without mesh"])
    print(f"added by the mesh: {added:.2f} µs per request")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
