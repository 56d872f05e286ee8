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
from kvmesh.router.replies import error_response

_ANTHROPIC_KINDS = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def api_error(
    api: PromptApi, status: int, message: str, *, param: str | None = None, kind: str | None = None
) -> web.Response:
    """An error reply in the shape ``api``'s clients parse.

    Args:
        api: the API the request used.
        status: the HTTP status.
        message: what went wrong, for the client.
        param: the request field at fault (OpenAI shape only).
        kind: the error type (default: by status).
    """
    if api is PromptApi.MESSAGES:
        return web.Response(
            status=status, body=error_body(api, status, message, kind=kind), content_type="application/json"
        )
    return error_response(status, message, param=param, kind=kind or "invalid_request_error")


def error_body(
    api: PromptApi | None, status: int, message: str, *, param: str | None = None, kind: str | None = None
) -> bytes:
    """The JSON body of :func:`api_error` (OpenAI's shape when ``api`` is ``None``)."""
    if api is PromptApi.MESSAGES:
        body: dict[str, object] = {
            "type": "error",
            "error": {"type": kind or _ANTHROPIC_KINDS.get(status, "api_error"), "message": message},
        }
    else:
        body = {
            "error": {
                "message": message,
                "type": kind or "invalid_request_error",
                "param": param,
                "code": status,
            }
        }
    return msgspec.json.encode(body)


def api_of_path(path: str) -> PromptApi | None:
    """The agent API whose route ``path`` is (``None`` for the others)."""
    if path == PromptApi.MESSAGES.path:
        return PromptApi.MESSAGES
    if path == PromptApi.RESPONSES.path:
        return PromptApi.RESPONSES
    return None


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
