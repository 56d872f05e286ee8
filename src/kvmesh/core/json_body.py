"""The 400 for a request body that is not JSON, worded alike by the engine and the router."""

from __future__ import annotations

import msgspec

from kvmesh.errors import RequestError

NOT_JSON_ERRORS = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
"""What ``msgspec.json.decode`` raises on bytes that are not JSON (a ``ValidationError`` is a
``DecodeError`` too: catch it first where a typed decode should name the field)."""


def not_json_error(what: str, exc: Exception) -> RequestError:
    """The client error for ``exc``, one of :data:`NOT_JSON_ERRORS`, after the words ``what``.

    Args:
        what: the start of the message, e.g. ``"invalid JSON body"``.
        exc: what the decoder raised.
    """
    if isinstance(exc, UnicodeDecodeError):
        return RequestError(f"{what}: not UTF-8: {exc}")
    if isinstance(exc, RecursionError):
        return RequestError(f"{what}: nested too deeply")
    return RequestError(f"{what}: {exc}")
