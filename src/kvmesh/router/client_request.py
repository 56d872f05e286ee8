"""What the completion routes need of a client's request, whichever server received it.

The routes that carry inference traffic (``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses``, ``/v1/messages``) are served by the router's own front
(:mod:`kvmesh.router.front_http`) and, on the aiohttp app, by aiohttp. Both requests satisfy
:class:`ClientRequest`; a streamed answer is opened with :func:`open_stream`, which prepares an
aiohttp response on aiohttp's request and writes the head itself on the front's.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, cast

from aiohttp import web
from multidict import MultiMapping


class ClientRequest(Protocol):
    """A client's HTTP request as the gateway's completion routes read it."""

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str:
        """The path, without the query (what the endpoint is sent)."""
        ...

    @property
    def headers(self) -> MultiMapping[str]:
        """Case-insensitive; a repeated header has each of its values."""
        ...

    @property
    def transport(self) -> asyncio.BaseTransport | None:
        """The client's connection (closing or ``None``: the client went away)."""
        ...

    async def read(self) -> bytes:
        """The whole body (aiohttp's raises ``HTTPRequestEntityTooLarge`` past its limit)."""
        ...


class StreamSink(Protocol):
    """Where a streamed answer's body goes once its head is sent."""

    async def write(self, data: bytes) -> None:
        """Send ``data`` (``ConnectionResetError``: the client went away)."""

    async def write_eof(self, data: bytes = b"") -> None:
        """Send ``data`` and end the answer."""


class StreamOpener(Protocol):
    async def open_stream(self, response: web.StreamResponse) -> StreamSink:
        """Send ``response``'s status and headers; the body follows through the sink."""
        ...


async def open_stream(request: ClientRequest, response: web.StreamResponse) -> StreamSink:
    """Send ``response``'s head to the client of ``request``; write the body to what is returned
    (``response`` itself on aiohttp). The handler returns ``response`` once done."""
    if isinstance(request, web.BaseRequest):
        await response.prepare(request)
        return response
    return await cast(StreamOpener, request).open_stream(response)  # the front's request
