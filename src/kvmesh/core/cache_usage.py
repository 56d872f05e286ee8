"""What an engine reports about the cache behind one answer, beyond OpenAI's ``cached_tokens``.

In the body, ``usage.prompt_tokens_details`` carries, besides ``cached_tokens``::

    "kvmesh_cached_tokens_by_tier": {"GPU": 64, "SHARED": 32}   # tiers that served them
    "kvmesh_store_fault": true                                  # only when a store read failed

The kvmesh engine also sends the same figures as a response header, which goes out with its first
token, so a router can report them before a stream's last chunk (where usage comes)::

    x-kvmesh-cached: cached=96;prompt=120;tiers=GPU:64,SHARED:32[;store_fault=1]

Tier names are :class:`~kvmesh.core.types.Medium` values (``GPU`` is the engine's device tier).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

CACHED_BY_TIER_FIELD = "kvmesh_cached_tokens_by_tier"
"""``usage.prompt_tokens_details`` field: cached prompt tokens per tier that served them."""
STORE_FAULT_FIELD = "kvmesh_store_fault"
"""``usage.prompt_tokens_details`` field, present (``true``) when a store read for the prompt failed."""
ENGINE_CACHED_HEADER = "x-kvmesh-cached"
"""Engine response header with the request's cache figures (see the module docstring)."""
CACHE_HEADER = "x-kvmesh-cache"
"""Router response header: cached/prompt tokens and why the rest missed (docs/router.md)."""
REQUEST_ID_HEADER = "x-request-id"
"""The client's request id, or the one the router assigned (returned on every routed answer)."""


def header_fields(value: str) -> dict[str, str]:
    """The ``key=value`` items of a ``;``-separated header value (:data:`CACHE_HEADER`,
    :data:`ENGINE_CACHED_HEADER`); items without ``=`` are left out."""
    fields: dict[str, str] = {}
    for part in value.split(";"):
        key, sep, val = part.partition("=")
        if sep:
            fields[key.strip()] = val.strip()
    return fields


@dataclass(slots=True)
class CacheUsage:
    """One answer's cache figures as the engine reported them.

    Attributes:
        cached_tokens: prompt tokens served from any cache.
        prompt_tokens: prompt tokens (``None`` when the report did not say).
        by_tier: cached tokens per tier (empty when the engine does not report tiers).
        store_fault: a store read for this prompt failed (the engine recomputed that part).
    """

    cached_tokens: int
    prompt_tokens: int | None = None
    by_tier: dict[str, int] = field(default_factory=dict)
    store_fault: bool = False

    def header_value(self) -> str:
        """The :data:`ENGINE_CACHED_HEADER` value."""
        parts = [f"cached={self.cached_tokens}"]
        if self.prompt_tokens is not None:
            parts.append(f"prompt={self.prompt_tokens}")
        if self.by_tier:
            parts.append("tiers=" + ",".join(f"{t}:{n}" for t, n in self.by_tier.items()))
        if self.store_fault:
            parts.append("store_fault=1")
        return ";".join(parts)

    @classmethod
    def from_header(cls, value: str | None) -> CacheUsage | None:
        """Parse an :data:`ENGINE_CACHED_HEADER` value; ``None`` when absent or malformed."""
        if not value:
            return None
        fields = header_fields(value)
        try:
            cached = int(fields["cached"])
            prompt = int(fields["prompt"]) if "prompt" in fields else None
            by_tier = {}
            for item in filter(None, fields.get("tiers", "").split(",")):
                tier, _, n = item.partition(":")
                by_tier[tier] = int(n)
        except (KeyError, ValueError):
            return None
        if cached < 0:
            return None
        return cls(cached, prompt, by_tier, fields.get("store_fault") == "1")

    @classmethod
    def from_usage(cls, usage: Any) -> CacheUsage | None:
        """Read an OpenAI ``usage`` object (chat and completions, or ``/v1/responses``'
        ``input_tokens``) or an Anthropic one (``cache_read_input_tokens``); ``None`` when it has
        no integer cached-token count."""
        if not isinstance(usage, dict) and not isinstance(usage, Mapping):  # dicts skip the ABC check
            return None
        if "cache_read_input_tokens" in usage:
            return _anthropic_usage(usage)
        responses = "input_tokens_details" in usage
        details = usage.get("input_tokens_details" if responses else "prompt_tokens_details")
        if not isinstance(details, dict) and not isinstance(details, Mapping):
            return None
        cached = details.get("cached_tokens")
        if type(cached) is not int or cached < 0:
            return None
        prompt = usage.get("input_tokens" if responses else "prompt_tokens")
        raw_tiers = details.get(CACHED_BY_TIER_FIELD)
        by_tier = (
            {str(t): n for t, n in raw_tiers.items() if type(n) is int and n > 0}
            if isinstance(raw_tiers, Mapping)
            else {}
        )
        return cls(
            cached,
            prompt if type(prompt) is int and prompt >= 0 else None,
            by_tier,
            details.get(STORE_FAULT_FIELD) is True,
        )

    def usage_details(self) -> dict[str, Any]:
        """The ``usage.prompt_tokens_details`` object an engine answers with."""
        details: dict[str, Any] = {
            "cached_tokens": self.cached_tokens,
            CACHED_BY_TIER_FIELD: dict(self.by_tier),
        }
        if self.store_fault:
            details[STORE_FAULT_FIELD] = True
        return details


def _anthropic_usage(usage: Mapping[str, Any]) -> CacheUsage | None:
    """Anthropic's usage: ``input_tokens`` excludes the cache reads and writes."""
    cached = usage.get("cache_read_input_tokens")
    fresh = usage.get("input_tokens")
    written = usage.get("cache_creation_input_tokens") or 0
    if type(cached) is not int or cached < 0 or type(fresh) is not int or type(written) is not int:
        return None
    return CacheUsage(cached, cached + fresh + written, {}, False)
