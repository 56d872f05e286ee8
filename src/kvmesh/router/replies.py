"""The gateway's own JSON answers: OpenAI's error shape and plain JSON bodies."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web


def error_response(
    status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error"
) -> web.Response:
    """An OpenAI-style error body with ``status``.

    Args:
        status: the HTTP status, repeated as the error's ``code``.
        message: what went wrong, for the client.
        param: the request field at fault, if one is.
        kind: OpenAI's error ``type``.
    """
    return web.Response(
        status=status,
        body=error_body(status, message, param=param, kind=kind),
        content_type="application/json",
    )


def error_body(
    status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error"
) -> bytes:
    """The JSON body of :func:`error_response`."""
    return msgspec.json.encode({"error": {"message": message, "type": kind, "param": param, "code": status}})


def json_response(body: Any, *, status: int = 200) -> web.Response:
    """``body`` encoded as JSON."""
    return web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json")
