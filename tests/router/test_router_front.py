"""The router's HTTP front on loopback: its own routes, the relay to the app, and HTTP's edges."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from front_testing import FrontTestServer

from kvmesh.router import front_server
from kvmesh.router.client_request import ClientRequest, open_stream
from kvmesh.router.front_http import MAX_LINE_BYTES

MAX_BODY = 4096


async def echo(request: ClientRequest) -> web.StreamResponse:
    body = await request.read()
    return web.json_response(
        {
            "method": request.method,
            "path": request.path,
            "body": body.decode(),
            "auth": request.headers.getall("x-auth", []),
        },
        headers={"x-handled": "front"},
    )


async def stream(request: ClientRequest) -> web.StreamResponse:
    response = web.StreamResponse(status=200)
    response.headers["Content-Type"] = "text/event-stream"
    sink = await open_stream(request, response)
    for i in range(3):
        await sink.write(f"data: {i}\n\n".encode())
        await asyncio.sleep(0.01)
    await sink.write_eof()
    return response


async def broken(request: ClientRequest) -> web.StreamResponse:
    raise RuntimeError("a bug in a handler")


async def wait_then_answer(request: ClientRequest) -> web.StreamResponse:
    await asyncio.sleep(0.3)
    return web.json_response({"waited": True})


ROUTES = {
    "/echo": echo,
    "/stream": stream,
    "/broken": broken,
    "/slow": wait_then_answer,
    "/v1/messages": broken,
}


def behind_app() -> web.Application:
    async def info(request: web.Request) -> web.Response:
        return web.json_response(
            {"from": "app", "query": request.query_string, "body": (await request.read()).decode()},
            headers={"x-app": "1"},
        )

    async def app_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(3):
            await response.write(f"part{i};".encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/info", info)
    app.router.add_post("/info", info)
    app.router.add_post("/echo/under", info)  # a POST route the front does not serve
    app.router.add_get("/echo", info)  # a GET on a path the front serves for POST
    app.router.add_get("/app-stream", app_stream)
    return app


@pytest.fixture
async def client() -> AsyncIterator[TestClient]:
    c = TestClient(FrontTestServer(behind_app(), ROUTES, max_body_bytes=MAX_BODY))
    await c.start_server()
    yield c
    await c.close()


async def raw_exchange(
    port: int, data: bytes, *, read_until_close: bool = True, timeout: float = 5.0
) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = b""
    try:
        async with asyncio.timeout(timeout):
            if read_until_close:
                out = await reader.read(-1)
            else:
                out = await reader.read(65536)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return out


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


async def test_its_routes_are_answered_by_the_front_and_the_rest_by_the_app(client: TestClient) -> None:
    resp = await client.post("/echo", data=b"hi", headers=[("x-auth", "a"), ("x-auth", "b")])
    assert resp.status == 200 and resp.headers["x-handled"] == "front"
    assert await resp.json() == {"method": "POST", "path": "/echo", "body": "hi", "auth": ["a", "b"]}
    resp = await client.get("/info?x=1")
    assert resp.status == 200 and resp.headers["x-app"] == "1"
    assert await resp.json() == {"from": "app", "query": "x=1", "body": ""}
    assert resp.headers.getall("Date") and len(resp.headers.getall("Date")) == 1
    for method, path in (("POST", "/info"), ("POST", "/echo/under"), ("GET", "/echo")):
        resp = await client.request(method, path, data=b"payload" if method == "POST" else None)
        assert resp.status == 200, (method, path)
        body = await resp.json()
        assert body["from"] == "app" and body["body"] == ("payload" if method == "POST" else "")
    resp = await client.get("/no-such-route")
    assert resp.status == 404
    resp = await client.head("/info")
    assert resp.status == 200 and int(resp.headers["Content-Length"]) > 0


async def test_a_connection_is_kept_alive_and_streams_are_chunked(client: TestClient) -> None:
    front = client.server.front  # type: ignore[attr-defined]
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        url = str(client.make_url(""))
        for _ in range(3):
            async with session.post(url + "/echo", data=b"x") as resp:
                assert resp.status == 200
        async with session.post(url + "/stream") as resp:
            assert resp.headers["Transfer-Encoding"] == "chunked"
            parts = [chunk async for chunk in resp.content.iter_any()]
            assert b"".join(parts) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
            assert len(parts) >= 2  # written as they came, not collected
        async with session.get(url + "/app-stream") as resp:
            assert await resp.read() == b"part0;part1;part2;"
        assert len(front.connections) == 1


async def test_http10_clients_are_kept_alive_when_they_ask_and_streams_are_not_chunked(
    client: TestClient,
) -> None:
    def http10(method: str, path: str, body: bytes = b"", keep_alive: bool = True) -> bytes:
        extra = "Connection: keep-alive\r\n" if keep_alive else ""
        return f"{method} {path} HTTP/1.0\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body

    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    try:
        for request in (http10("POST", "/echo", b"a"), http10("GET", "/info")):  # front, then relayed
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200 ") and b"Connection: keep-alive" in head, head
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            await asyncio.wait_for(reader.readexactly(length), 5)
    finally:
        writer.close()
    for path, body in (
        ("/stream", b"data: 0\n\ndata: 1\n\ndata: 2\n\n"),
        ("/app-stream", b"part0;part1;part2;"),
    ):
        method = "POST" if path == "/stream" else "GET"
        out = await raw_exchange(client.port, http10(method, path))  # type: ignore[arg-type]
        head, _, got = out.partition(b"\r\n\r\n")
        assert b"Transfer-Encoding" not in head and b"Connection: close" in head, head
        assert got == body
    out = await raw_exchange(client.port, http10("POST", "/echo", b"b", keep_alive=False))  # type: ignore[arg-type]
    assert b"Connection: close" in out.partition(b"\r\n\r\n")[0]


async def test_an_absolute_form_target_is_served_by_its_path(client: TestClient) -> None:
    data = post("http://router.example/echo?x=1", b"abs", "Connection: close\r\n")
    out = await raw_exchange(client.port, data)  # type: ignore[arg-type]
    assert out.startswith(b"HTTP/1.1 200 OK") and b'"path": "/echo"' in out and b'"body": "abs"' in out


async def test_pipelined_requests_are_answered_in_order(client: TestClient) -> None:
    data = post("/slow", b"{}") + post("/echo", b"second", "Connection: close\r\n")
    out = await raw_exchange(client.port, data)  # type: ignore[arg-type]
    first, second = out.split(b"HTTP/1.1 200 OK")[1:]
    assert b'{"waited": true}' in first and b'"body": "second"' in second and b"Connection: close" in second


async def test_a_client_pipelining_far_ahead_gets_every_answer_in_order(client: TestClient) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(b"".join(post("/echo", b"n%d" % i) for i in range(19)))  # reading pauses past 8 queued
    out = b""
    while out.count(b"HTTP/1.1 200 OK") < 19 or not out.endswith(b"}"):
        out += await asyncio.wait_for(reader.read(65536), 5)
    writer.write(post("/echo", b"n19", "Connection: close\r\n"))  # read once the queue is drained
    out += await asyncio.wait_for(reader.read(-1), 5)
    writer.close()
    bodies = [part.split(b'"body": "')[1].split(b'"')[0] for part in out.split(b"HTTP/1.1 200 OK")[1:]]
    assert bodies == [b"n%d" % i for i in range(20)]


async def test_chunked_request_bodies_and_expect_continue(client: TestClient) -> None:
    chunked = (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    out = await raw_exchange(client.port, chunked)  # type: ignore[arg-type]
    assert out.startswith(b"HTTP/1.1 200 OK") and b'"body": "abcde"' in out
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"body")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 OK")
    writer.close()


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (post("/echo", b"x" * (MAX_BODY + 1)), 413),
        (
            b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"1000\r\n"
            + b"x" * 4096
            + b"\r\n1\r\nx\r\n0\r\n\r\n",
            413,
        ),
        (b"GET /info HTTP/1.1\r\nX-Long: " + b"a" * (MAX_LINE_BYTES + 1) + b"\r\n\r\n", 431),
        (
            b"GET /info HTTP/1.1\r\n"
            + b"".join(b"X-%d: %b\r\n" % (i, b"a" * 8000) for i in range(9))
            + b"\r\n",
            431,
        ),
        (b"GET /" + b"a" * (MAX_LINE_BYTES + 1) + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET /chat HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n", 400),
    ],
    ids=[
        "malformed",
        "too-large",
        "too-large-chunked",
        "header-too-long",
        "head-too-long",
        "target-too-long",
        "upgrade",
    ],
)
async def test_bad_requests_get_a_clear_4xx_and_the_connection_closes(
    client: TestClient, data: bytes, status: int
) -> None:
    out = await raw_exchange(client.port, data)  # type: ignore[arg-type]
    assert out.startswith(f"HTTP/1.1 {status} ".encode()), out[:80]
    assert b"Connection: close" in out
    body = msgspec.json.decode(out.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == status and body["error"]["message"]


async def test_errors_on_the_messages_route_come_in_anthropics_shape(client: TestClient) -> None:
    chunked_too_large = (
        b"POST /v1/messages?beta=true HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"1000\r\n"
        + b"x" * 4096
        + b"\r\n1\r\nx\r\n0\r\n\r\n"
    )
    for data, status, kind in (
        (post("/v1/messages", b"x" * (MAX_BODY + 1)), 413, "request_too_large"),
        (chunked_too_large, 413, "request_too_large"),
        (post("/v1/messages", b"{}", "Connection: close\r\n"), 500, "api_error"),
    ):
        out = await raw_exchange(client.port, data)  # type: ignore[arg-type]
        assert out.startswith(f"HTTP/1.1 {status} ".encode()), out[:80]
        body = msgspec.json.decode(out.split(b"\r\n\r\n", 1)[1])
        assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    out = await raw_exchange(client.port, post("/echo", b"x" * (MAX_BODY + 1)))  # type: ignore[arg-type]
    assert msgspec.json.decode(out.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 413


async def test_a_handler_error_is_a_500_and_the_connection_serves_on(client: TestClient) -> None:
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        url = str(client.make_url(""))
        async with session.post(url + "/broken") as resp:
            assert resp.status == 500 and (await resp.json())["error"]["type"] == "server_error"
        async with session.post(url + "/echo", data=b"after") as resp:
            assert (await resp.json())["body"] == "after"


async def test_the_app_gone_is_a_502(client: TestClient) -> None:
    await client.server.runner.cleanup()  # type: ignore[union-attr]
    resp = await client.get("/info")
    assert resp.status == 502 and "did not answer" in (await resp.json())["error"]["message"]
    resp = await client.post("/echo", data=b"still")
    assert resp.status == 200


async def test_draining_closes_each_connection_after_its_answer(client: TestClient) -> None:
    front = client.server.front  # type: ignore[attr-defined]
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    drained = asyncio.create_task(front.drain(10.0, poll_s=0.01))
    await asyncio.sleep(0.05)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", client.port)  # no longer listening
    writer.write(post("/echo", b"last"))
    out = await asyncio.wait_for(reader.read(-1), 5)  # read until the front closes
    assert b"Connection: close" in out and b'"body": "last"' in out
    await asyncio.wait_for(drained, 5)
    assert not front.connections


async def test_idle_connections_are_closed_after_the_keepalive(client: TestClient, monkeypatch) -> None:
    front = client.server.front  # type: ignore[attr-defined]
    await front.aclose(0)
    monkeypatch.setattr(front_server, "SWEEP_S", 0.05)
    front = front_server.FrontServer(
        ROUTES, front.relay.socket_path, max_body_bytes=MAX_BODY, keepalive_s=0.2
    )
    await front.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(post("/echo", b"x"))
        await reader.readuntil(b'"auth": []}')
        assert len(front.connections) == 1
        assert await asyncio.wait_for(reader.read(-1), 5) == b""  # closed by the front
        assert not front.connections
        writer.close()
        # a request that stops halfway is dropped after the same time
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(b"POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
        assert await asyncio.wait_for(reader.read(-1), 5) == b""
        writer.close()
    finally:
        await front.aclose(1.0)


async def test_a_client_gone_mid_stream_is_a_reset_for_the_writer(client: TestClient) -> None:
    seen: list[BaseException] = []
    started = asyncio.Event()

    async def endless(request: ClientRequest) -> web.StreamResponse:
        response = web.StreamResponse()
        sink = await open_stream(request, response)
        started.set()
        try:
            while True:
                await sink.write(b"data: tick\n\n")
                await asyncio.sleep(0.01)
        except ConnectionResetError as exc:
            seen.append(exc)
        assert request.transport is None or request.transport.is_closing()
        return response

    client.server.front.routes["/endless"] = endless  # type: ignore[attr-defined]
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(post("/endless", b""))
    await asyncio.wait_for(started.wait(), 5)
    await reader.readuntil(b"tick")
    writer.close()
    for _ in range(200):
        if seen:
            break
        await asyncio.sleep(0.01)
    assert seen and isinstance(seen[0], ConnectionResetError)
