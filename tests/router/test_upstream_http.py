"""The router's HTTP client to its endpoints, against real servers on loopback: aiohttp apps for
the ordinary answers, hand-written socket servers for the broken ones."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.errors import UpstreamError, UpstreamUnreachableError
from kvmesh.router.upstream_http import Origin, UpstreamClient

JSON = {"Content-Type": "application/json"}


def app_starter(runners: list[web.AppRunner]) -> Callable[[web.Application], Awaitable[str]]:
    """Serves an app on an ephemeral loopback port (its runner kept in ``runners`` to clean up)."""

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    return start


@pytest.fixture
async def app_server() -> AsyncIterator[Callable[[web.Application], Awaitable[str]]]:
    runners: list[web.AppRunner] = []
    yield app_starter(runners)
    for runner in runners:
        await runner.cleanup()


async def raw_server(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


def echo_app(peers: list[tuple[str, int]] | None = None, delay_s: float = 0.0) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        if peers is not None:
            peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        if delay_s:
            await asyncio.sleep(delay_s)
        body = await request.read()
        return web.Response(
            body=body,
            content_type="application/json",
            headers={"X-Seen-Auth": request.headers.get("Authorization", "")},
        )

    app = web.Application()
    app.router.add_post("/v1/completions", echo)
    app.router.add_post("/prefix/v1/completions", echo)
    return app


async def test_a_connection_is_kept_alive_across_requests(app_server) -> None:
    peers: list[tuple[str, int]] = []
    url = await app_server(echo_app(peers))
    client = UpstreamClient()
    for i in range(20):
        resp = await client.post(
            url, "/v1/completions", b'{"n": %d}' % i, {**JSON, "Authorization": "Bearer t"}, timeout_s=5
        )
        assert (resp.status, await resp.read()) == (200, b'{"n": %d}' % i)
        assert resp.headers["x-seen-auth"] == "Bearer t"
        assert resp.headers["content-type"].startswith("application/json")
        resp.release()
    assert len(set(peers)) == 1 and client.num_open(url) == 1
    await client.aclose()


async def test_an_endpoint_url_path_prefixes_the_route(app_server) -> None:
    url = await app_server(echo_app())
    client = UpstreamClient()
    resp = await client.post(url + "/prefix/", "/v1/completions", b"{}", JSON, timeout_s=5)
    assert resp.status == 200 and await resp.read() == b"{}"
    resp.release()
    await client.aclose()


async def test_connections_per_endpoint_are_bounded_and_waiters_served(app_server) -> None:
    peers: list[tuple[str, int]] = []
    url = await app_server(echo_app(peers, delay_s=0.05))
    client = UpstreamClient(max_connections_per_endpoint=2)

    async def one(i: int) -> bytes:
        resp = await client.post(url, "/v1/completions", b"%d" % i, JSON, timeout_s=5)
        try:
            return await resp.read()
        finally:
            resp.release()

    assert await asyncio.gather(*(one(i) for i in range(6))) == [b"%d" % i for i in range(6)]
    assert len(set(peers)) == 2 and client.num_open(url) == 2
    await client.aclose()


async def test_a_waiter_times_out_when_no_connection_frees(app_server) -> None:
    url = await app_server(echo_app(delay_s=1.0))
    client = UpstreamClient(max_connections_per_endpoint=1)
    first = asyncio.create_task(client.post(url, "/v1/completions", b"{}", JSON, timeout_s=5))
    await asyncio.sleep(0.1)
    second = asyncio.create_task(client.post(url, "/v1/completions", b"{}", JSON, timeout_s=0.2))
    await asyncio.sleep(0.05)
    assert client.connection_counts() == {url: (1, 0, 1)}  # busy, idle, waiting
    with pytest.raises(TimeoutError):
        await second
    assert client.connection_counts() == {url: (1, 0, 0)}
    resp = await first
    await resp.read()
    resp.release()
    assert client.connection_counts() == {url: (0, 1, 0)}
    await client.aclose()


async def test_a_stream_is_relayed_chunk_by_chunk(app_server) -> None:
    second_may_go = asyncio.Event()

    async def sse(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await second_may_go.wait()
        await resp.write(b"data: 2\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", sse)
    url = await app_server(app)
    client = UpstreamClient()
    resp = await client.post(url, "/v1/completions", b"{}", JSON, timeout_s=5)
    assert resp.headers["content-type"] == "text/event-stream"
    chunks = resp.iter_chunks()
    assert await asyncio.wait_for(anext(chunks), 2) == b"data: 1\n\n"  # before the second exists
    second_may_go.set()
    assert b"".join([c async for c in chunks]) == b"data: 2\n\n"
    resp.release()
    assert client.num_open(url) == 1  # read to its end: kept alive
    await client.aclose()


async def test_a_large_answer_read_whole_or_slowly_in_chunks(app_server) -> None:
    await _read_large_answers(app_server)


def test_a_large_answer_read_whole_or_slowly_in_chunks_on_uvloop() -> None:
    async def run() -> None:
        runners: list[web.AppRunner] = []
        try:
            await _read_large_answers(app_starter(runners))
        finally:
            for runner in runners:
                await runner.cleanup()

    uvloop.run(run())


async def _read_large_answers(app_server: Callable[[web.Application], Awaitable[str]]) -> None:
    payload = bytes(range(256)) * 8192  # 2 MiB

    async def big(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(0, len(payload), 65536):
            await resp.write(payload[i : i + 65536])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", big)
    url = await app_server(app)
    client = UpstreamClient()
    resp = await client.post(url, "/v1/completions", b"{}", JSON, timeout_s=10)
    assert await resp.read() == payload
    resp.release()
    resp = await client.post(url, "/v1/completions", b"{}", JSON, timeout_s=10)
    got = bytearray()
    async for chunk in resp.iter_chunks():
        got += chunk
        await asyncio.sleep(0.001)  # a slow client: the socket is paused and resumed
    assert bytes(got) == payload
    resp.release()
    await client.aclose()


@settings(max_examples=40, deadline=None)
@given(
    body=st.binary(min_size=0, max_size=3000),
    chunked=st.booleans(),
    cuts=st.lists(st.integers(min_value=1, max_value=4000), max_size=8),
)
def test_any_split_of_an_answer_reads_the_same_body(body: bytes, chunked: bool, cuts: list[int]) -> None:
    if chunked:
        pieces = [body[i : i + 700] for i in range(0, len(body), 700)]
        framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + framed
    else:
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    points = sorted({c % (len(answer) + 1) for c in cuts} | {0, len(answer)})

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):  # the same answer twice on one connection
            await read_request(reader)
            for a, b in itertools.pairwise(points):
                writer.write(answer[a:b])
                await writer.drain()
                await asyncio.sleep(0)
        writer.close()

    async def run() -> None:
        server, url = await raw_server(handle)
        client = UpstreamClient()
        for _ in range(2):
            resp = await client.post(url, "/v1/completions", b"{}", JSON, timeout_s=5)
            assert await resp.read() == body
            resp.release()
        assert client.num_open(url) <= 1
        await client.aclose()
        server.close()

    uvloop.run(run())  # the router's event loop


async def test_a_refused_connection_is_unreachable() -> None:
    server, url = await raw_server(lambda r, w: asyncio.sleep(0))
    server.close()
    await server.wait_closed()
    with pytest.raises(UpstreamUnreachableError):
        await UpstreamClient().post(url, "/v1/completions", b"{}", JSON, timeout_s=2)


async def test_a_connection_closed_before_any_answer_is_unreachable() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()

    server, url = await raw_server(hang_up)
    client = UpstreamClient()
    with pytest.raises(UpstreamUnreachableError):
        await client.post(url, "/v1/completions", b"{}", JSON, timeout_s=2)
    assert client.num_open(url) == 0
    server.close()


async def test_a_kept_alive_connection_closed_as_it_is_reused_is_retried_once() -> None:
    accepted = 0

    async def one_answer_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await read_request(reader)  # the next request arrives, and the endpoint hangs up on it
        writer.close()

    server, url = await raw_server(one_answer_per_connection)
    client = UpstreamClient()
    for _ in range(3):
        resp = await client.post(url, "/v1/completions", b"{}", JSON, timeout_s=2)
        assert await resp.read() == b"ok"
        resp.release()
    assert accepted == 3  # each reuse failed once, then a new connection answered
    server.close()


async def test_an_answer_cut_short_is_an_error_not_unreachable() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        await writer.drain()
        writer.close()

    server, url = await raw_server(cut)
    client = UpstreamClient()
    resp = await client.post(url, "/v1/completions", b"{}", JSON, timeout_s=2)
    with pytest.raises(UpstreamError) as info:
        await resp.read()
    assert not isinstance(info.value, UpstreamUnreachableError)
    resp.release()
    assert client.num_open(url) == 0
    server.close()


async def test_a_body_without_length_ends_with_the_connection() -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    server, url = await raw_server(until_close)
    client = UpstreamClient()
    resp = await client.post(url, "/v1/completions", b"{}", JSON, timeout_s=2)
    assert await resp.read() == b"all of it"
    resp.release()
    assert client.num_open(url) == 0
    server.close()


async def test_an_answer_saying_connection_close_is_not_reused() -> None:
    async def close_later(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(5)  # still open: only the header says it will not be reused

    server, url = await raw_server(close_later)
    client = UpstreamClient()
    resp = await client.post(url, "/v1/completions", b"{}", JSON, timeout_s=2)
    assert await resp.read() == b"ok"
    resp.release()
    assert client.num_open(url) == 0
    server.close()


async def test_malformed_http_is_an_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"not http at all\r\n\r\n")
        await writer.drain()

    server, url = await raw_server(garbage)
    with pytest.raises(UpstreamError, match="malformed"):
        await UpstreamClient().post(url, "/v1/completions", b"{}", JSON, timeout_s=2)
    server.close()


async def test_the_deadline_covers_the_body_and_closes_the_connection() -> None:
    async def slow_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234")
        await writer.drain()
        await asyncio.sleep(5)

    server, url = await raw_server(slow_body)
    client = UpstreamClient()
    resp = await client.post(url, "/v1/completions", b"{}", JSON, timeout_s=0.3)
    with pytest.raises(TimeoutError):
        await resp.read()
    resp.release()
    assert client.num_open(url) == 0
    server.close()


async def test_an_answer_released_unread_closes_its_connection(app_server) -> None:
    url = await app_server(echo_app())
    client = UpstreamClient()
    resp = await client.post(url, "/v1/completions", b"x" * 100_000, JSON, timeout_s=5)
    resp.release()
    await asyncio.sleep(0.05)
    assert client.num_open(url) == 0
    await client.aclose()


async def test_idle_connections_close_after_keepalive_and_unused_endpoints_are_forgotten(app_server) -> None:
    url = await app_server(echo_app())
    client = UpstreamClient(keepalive_s=0.1)
    resp = await client.post(url, "/v1/completions", b"{}", JSON, timeout_s=5)
    await resp.read()
    resp.release()
    assert client.num_open(url) == 1 and client.num_hosts() == 1
    await asyncio.sleep(0.15)
    assert client.num_open(url) == 0  # closed after keepalive
    await asyncio.sleep(0.2)
    assert client.num_hosts() == 0  # and the endpoint forgotten a keepalive later
    resp = await client.post(url, "/v1/completions", b"{}", JSON, timeout_s=5)  # starts anew
    assert await resp.read() == b"{}"
    resp.release()
    await client.aclose()


async def test_headers_the_client_owns_are_its_own_and_line_breaks_refused() -> None:
    seen: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    server, url = await raw_server(record)
    client = UpstreamClient()
    resp = await client.post(
        url, "/v1/completions", b"abc", {**JSON, "Content-Length": "999", "Host": "x"}, timeout_s=2
    )
    assert resp.status == 204 and await resp.read() == b""
    resp.release()
    head = seen[0].split(b"\r\n\r\n")[0].lower().split(b"\r\n")
    assert head[0] == b"post /v1/completions http/1.1"
    assert [h for h in head if h.startswith((b"content-length", b"host"))] == [
        b"host: " + url.split("//")[1].encode(),
        b"content-length: 3",
    ]
    with pytest.raises(ValueError, match="line break"):
        await client.post(url, "/v1/completions", b"", {"X-Evil": "a\r\nInjected: 1"}, timeout_s=2)
    await client.aclose()
    server.close()


def test_origins_parse_and_bad_urls_are_refused() -> None:
    assert Origin.parse("http://10.0.0.1:8000") == Origin("10.0.0.1", 8000, False, "", "10.0.0.1:8000")
    assert Origin.parse("https://svc.example/pre/") == Origin("svc.example", 443, True, "/pre", "svc.example")
    assert Origin.parse("http://[::1]:9000").host == "::1"
    with pytest.raises(ValueError, match="http"):
        Origin.parse("ftp://x:1")
