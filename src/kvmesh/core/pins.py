"""Pin requests: how a client asks that its prompt's prefix stays cached for a while.

One rule for the router and the engine. A request names a pin with any of::

    body     {"kvmesh": {"cache_ttl_s": 3600}}
    header   x-kvmesh-cache-ttl-s: 3600
    body     {"kv_transfer_params": {"kvmesh_cache_ttl_s": 3600}}   (what reaches a vLLM KV connector)

Given more than once, the values must agree; a value that is not a positive number of seconds is a
400. The router adds the ``kv_transfer_params`` form to the body it forwards
(:func:`with_pin_ttl`), because vLLM hands a KV connector only ``kv_transfer_params``; vLLM's
OpenAI server ignores the unknown top-level ``kvmesh`` field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvmesh.errors import RequestError

PIN_TTL_HEADER = "x-kvmesh-cache-ttl-s"
"""Request header naming a pin's lifetime in seconds."""

KVMESH_FIELD = "kvmesh"
"""Top-level body object with kvmesh's own request options."""

PIN_TTL_FIELD = "cache_ttl_s"
"""Key of the pin lifetime inside :data:`KVMESH_FIELD`."""

TRANSFER_PIN_TTL_FIELD = "kvmesh_cache_ttl_s"
"""Key of the pin lifetime inside ``kv_transfer_params`` (read by a vLLM KV connector)."""

PIN_BUDGET_STATUS = 429
"""HTTP status of a pin refused because it would exceed a pin budget (a quota, as hosted APIs
answer an exhausted one)."""

PIN_BUDGET_ERROR_TYPE = "pin_budget_exceeded"
"""OpenAI error ``type`` of a refused pin."""


def _as_ttl(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise RequestError(f"{where} must be a number of seconds, got {value!r}", param=KVMESH_FIELD)
    try:
        ttl = float(value)
    except ValueError:
        raise RequestError(
            f"{where} must be a number of seconds, got {value!r}", param=KVMESH_FIELD
        ) from None
    if not math.isfinite(ttl) or ttl <= 0:
        raise RequestError(f"{where} must be a positive number of seconds, got {value!r}", param=KVMESH_FIELD)
    return ttl


def requested_pin_ttl(headers: Mapping[str, str], body: Mapping[str, Any]) -> float | None:
    """The pin lifetime a request asks for, in seconds; ``None`` when it asks for none.

    Args:
        headers: the request headers (case-insensitive).
        body: the decoded JSON body.

    Raises:
        RequestError: a value is not a positive finite number, ``kvmesh`` is not an object, or two
            forms disagree.
    """
    found: list[tuple[str, float]] = []
    options = body.get(KVMESH_FIELD)
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError(f"'{KVMESH_FIELD}' must be an object", param=KVMESH_FIELD)
        if options.get(PIN_TTL_FIELD) is not None:
            where = f"{KVMESH_FIELD}.{PIN_TTL_FIELD}"
            found.append((where, _as_ttl(options[PIN_TTL_FIELD], where)))
    header = headers.get(PIN_TTL_HEADER)
    if header is not None:
        found.append((PIN_TTL_HEADER, _as_ttl(header.strip(), PIN_TTL_HEADER)))
    transfer = body.get("kv_transfer_params")
    if isinstance(transfer, dict) and transfer.get(TRANSFER_PIN_TTL_FIELD) is not None:
        where = f"kv_transfer_params.{TRANSFER_PIN_TTL_FIELD}"
        found.append((where, _as_ttl(transfer[TRANSFER_PIN_TTL_FIELD], where)))
    if not found:
        return None
    first_where, ttl = found[0]
    for where, other in found[1:]:
        if other != ttl:
            raise RequestError(
                f"{first_where} ({ttl:g}) and {where} ({other:g}) disagree", param=KVMESH_FIELD
            )
    return ttl


def check_pin_ttl(ttl_s: float, max_ttl_s: float) -> None:
    """Refuse a lifetime longer than the configured maximum.

    Raises:
        RequestError: ``ttl_s`` > ``max_ttl_s``.
    """
    if ttl_s > max_ttl_s:
        raise RequestError(
            f"{KVMESH_FIELD}.{PIN_TTL_FIELD} is {ttl_s:g} s, more than the maximum of {max_ttl_s:g} s",
            param=KVMESH_FIELD,
        )


def with_pin_ttl(body: dict[str, Any], ttl_s: float) -> dict[str, Any]:
    """``body`` carrying ``ttl_s`` in both body forms (changed in place and returned).

    ``kv_transfer_params`` keeps whatever else it held (a P/D role).
    """
    options = body.get(KVMESH_FIELD)
    body[KVMESH_FIELD] = {**(options if isinstance(options, dict) else {}), PIN_TTL_FIELD: ttl_s}
    transfer = body.get("kv_transfer_params")
    body["kv_transfer_params"] = {
        **(transfer if isinstance(transfer, dict) else {}),
        TRANSFER_PIN_TTL_FIELD: ttl_s,
    }
    return body


def transfer_pin_ttl(params: object) -> float | None:
    """The pin lifetime in a request's ``kv_transfer_params`` (what a vLLM KV connector sees).

    Returns ``None`` when there is none.

    Raises:
        RequestError: the value is not a positive finite number of seconds.
    """
    if not isinstance(params, dict) or params.get(TRANSFER_PIN_TTL_FIELD) is None:
        return None
    return _as_ttl(params[TRANSFER_PIN_TTL_FIELD], f"kv_transfer_params.{TRANSFER_PIN_TTL_FIELD}")
