"""Errors of the agent APIs (``/v1/responses``, ``/v1/messages``) in their clients' own shapes.

Anthropic clients read ``{"type": "error", "error": {"type", "message"}}``; OpenAI clients read
``{"error": {...}}`` (:func:`kvmesh.router.replies.error_response`). An endpoint that does not
serve an API answers 404 or 405 with no such error object (a framework's "Not Found"); the client
then gets a 4xx naming the API and the endpoint instead of that bare reply.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from kvmesh.core.agent_apis import PromptApi
from kvmesh.router.replies import error_body

_ANTHROPIC_KINDS = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def api_error(
    api: PromptApi | None, status: int, message: str, *, param: str | None = None, kind: str | None = None
) -> web.Response:
    """An error reply in the shape ``api``'s clients parse (OpenAI's when ``api`` is ``None``).

    Args:
        api: the API the request used.
        status: the HTTP status.
        message: what went wrong, for the client.
        param: the request field at fault (OpenAI shape only).
        kind: the error type (default: by status).
    """
    body = api_error_body(api, status, message, param=param, kind=kind)
    return web.Response(status=status, body=body, content_type="application/json")


def api_error_body(
    api: PromptApi | None, status: int, message: str, *, param: str | None = None, kind: str | None = None
) -> bytes:
    """The JSON body of :func:`api_error`."""
    if api is PromptApi.MESSAGES:
        anthropic = {"type": kind or _ANTHROPIC_KINDS.get(status, "api_error"), "message": message}
        return msgspec.json.encode({"type": "error", "error": anthropic})
    return error_body(status, message, param=param, kind=kind or "invalid_request_error")


_API_OF_PATH = {api.path: api for api in PromptApi}


def api_of_path(path: str) -> PromptApi | None:
    """The API whose route ``path`` is (``None`` for other paths)."""
    return _API_OF_PATH.get(path)


def maybe_unserved_api(api: PromptApi, response: web.StreamResponse, pod: str | None) -> web.StreamResponse:
    """``response`` unless it is an endpoint's bare 404/405 for an agent API, which becomes a
    4xx naming the API (an engine's own errors, such as an unknown model, carry an ``error``
    object and pass through)."""
    if api not in (PromptApi.RESPONSES, PromptApi.MESSAGES) or response.status not in (404, 405):
        return response
    if not isinstance(response, web.Response) or _has_error_object(response.body):
        return response
    where = f"endpoint {pod}" if pod else "the chosen endpoint"
    return api_error(
        api,
        response.status,
        f"{where} does not serve {api.path} (it answered {response.status}); "
        "route this API to engines that serve it",
        kind="not_found_error" if api is PromptApi.MESSAGES else "unsupported_api",
    )


def _has_error_object(body: object) -> bool:
    if not isinstance(body, bytes):
        return False
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    return isinstance(decoded, dict) and isinstance(decoded.get("error"), dict)
