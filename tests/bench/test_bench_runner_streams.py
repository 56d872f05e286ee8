"""A stream the client accepts ends with ``[DONE]``: one cut short is a failed request."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from bench_helpers import serve_post

from kvmesh.bench.runner import RunOptions, send_request
from kvmesh.workload import RequestSpec

CHUNK = b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
USAGE = (
    b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, '
    b'"prompt_tokens_details": {"cached_tokens": 2}}}\n\n'
)
NOTE = "cached=2;prompt=3;reason=partial_block"


async def _stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-kvmesh-cache": NOTE})
    await resp.prepare(request)
    await resp.write(CHUNK)
    await resp.write(CHUNK)
    if request.match_info["how"] == "whole":
        await resp.write(USAGE)
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@pytest.fixture
async def stub_url() -> AsyncIterator[str]:
    async with serve_post("/{how}/v1/completions", _stream) as url:
        yield url


@pytest.mark.parametrize("how", ["whole", "cut"])
async def test_a_stream_without_done_is_a_failure(stub_url: str, how: str) -> None:
    spec = RequestSpec(request_id="r", arrival_s=0.0, prompt_token_ids=[1, 2, 3], output_len=2)
    options = RunOptions(base_url=f"{stub_url}/{how}", model="m", progress=False)
    async with aiohttp.ClientSession() as session:
        result = await send_request(session, spec, options, 0.0)
    cut = how == "cut"
    assert result.ok is not cut
    assert result.error == ("stream ended before [DONE]" if cut else None)
    assert result.cache_note == NOTE
    assert result.cached_tokens == (0 if cut else 2)
