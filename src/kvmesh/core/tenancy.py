"""Who a request belongs to, and what part of it an engine serves: one rule for gateway and engine.

A tenant is named by the ``x-tenant-id`` header or by the body's ``cache_salt`` (vLLM's name for
the same thing). Both may be given only when they agree; a conflict is the client's error, answered
with a 400 by the router and by the engine alike, so a request never lands in a namespace its
sender did not ask for.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from kvmesh.errors import RequestError

TENANT_HEADER = "x-tenant-id"
"""The HTTP header naming a request's tenant."""

SESSION_HEADER = "x-session-id"
"""The HTTP header naming a conversation, for session affinity."""

ENDPOINT_HEADER = "x-kvmesh-endpoint"
"""Response header in which the router names the endpoint that served a request."""

CACHE_SALT_FIELD = "cache_salt"
"""The body field naming a request's tenant (vLLM's ``cache_salt``)."""

NO_TENANT = ""
"""The tenant of a request that names none."""


class Role(StrEnum):
    """What an engine, an endpoint or one request does in prefill/decode disaggregation."""

    BOTH = "both"
    """Whole requests: prefill and decode on the same engine."""
    PREFILL = "prefill"
    """Compute the prompt's KV, write it to the store, return after one token."""
    DECODE = "decode"
    """Load the prompt's KV from the store, then decode."""

    @classmethod
    def parse(cls, value: str | None) -> Role:
        """Parse a role name; ``None`` or empty means ``BOTH``.

        Raises:
            ValueError: an unknown role name.
        """
        if not value:
            return cls.BOTH
        try:
            return cls(value.lower())
        except ValueError as exc:
            raise ValueError(f"role must be one of both|prefill|decode, got {value!r}") from exc


def resolve_tenant(headers: Mapping[str, str], cache_salt: object) -> str:
    """The tenant of one request, from its headers and its body's ``cache_salt``.

    Args:
        headers: the request's headers (a case-insensitive mapping such as aiohttp's).
        cache_salt: the body's ``cache_salt`` value as decoded (``None`` when absent).

    Returns:
        The tenant, or :data:`NO_TENANT` when the request names none.

    Raises:
        RequestError: ``cache_salt`` is not a non-empty string, the header is empty, or the two
            name different tenants.
    """
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise RequestError(f"'{CACHE_SALT_FIELD}' must be a non-empty string", param=CACHE_SALT_FIELD)
    header = headers.get(TENANT_HEADER)
    if header is None:
        return cache_salt or NO_TENANT
    if not header:
        raise RequestError(f"{TENANT_HEADER} must not be empty")
    if cache_salt is not None and cache_salt != header:
        raise RequestError(
            f"{TENANT_HEADER} and {CACHE_SALT_FIELD} name different tenants", param=CACHE_SALT_FIELD
        )
    return header
