"""Why part of a prompt missed the cache: one reason from a fixed list, decided per request.

The router knows what it predicted when it routed (the index match of every endpoint, the
scheduler's scores) and learns what the engine served (``cached_tokens``). The missed part gets the
first reason that applies, checked in this order::

    none                 everything was served from cache
    block_size_mismatch  the endpoint's engine block size is no multiple of the router's: the
                         router cannot index that endpoint, so it cannot say more
    partial_block        only the block holding the prompt's last token was computed (engines never
                         serve it from cache, and a partial block is never cached)
    routed_for_load      another endpoint held more of the prefix; the scheduler's other terms won
    store_fault          the engine's store said it held more than it could read back
    evicted              the index predicted more than the engine served (gone meanwhile), or the
                         first missed block was seen in the index and has left it
    tokenization_differs the same leading text was tokenized into another first block before
    cold                 none of the above: this namespace never held the missed block

Everything consulted is the requester's own: the index match is made in its namespace, and both
memories (:mod:`kvmesh.router.cache_memory`) are keyed by values chained from its namespace root,
so another tenant's prompts can never change a reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.router.cache_memory import SeenBlocks
from kvmesh.router.types import Decision, PodMatch, PrefixMatch


class MissReason(StrEnum):
    """Why the missed part of a prompt missed (see the module docstring for the order)."""

    NONE = "none"
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    PARTIAL_BLOCK = "partial_block"
    ROUTED_FOR_LOAD = "routed_for_load"
    STORE_FAULT = "store_fault"
    EVICTED = "evicted"
    TOKENIZATION_DIFFERS = "tokenization_differs"
    COLD = "cold"


Detail = int | float | str


class CacheReportConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """Bounds of the cache usage report (``cacheReport`` in the router config)."""

    max_tenants: int = 256
    """Tenants counted on their own row in ``/admin/usage`` and the per-tenant metrics; the
    rest share the row ``(other)``."""
    explain_history: int = 1024
    """Requests kept for ``/admin/explain/{request_id}``."""
    seen_blocks: int = 262_144
    """Block keys remembered after they left the index (tells ``evicted`` from ``cold``)."""
    text_prefixes: int = 65_536
    """Leading-text fingerprints remembered (tells ``tokenization_differs``)."""

    def __post_init__(self) -> None:
        for name in ("max_tenants", "explain_history", "seen_blocks", "text_prefixes"):
            if getattr(self, name) < 0:
                raise ValueError(f"cacheReport.{name} must be >= 0")


@dataclass(slots=True)
class CacheVerdict:
    """One request's cache figures and the reason for its miss.

    Attributes:
        prompt_tokens: prompt tokens.
        cached_tokens: prompt tokens served from cache (the router's prediction when ``predicted``).
        reason: why the rest missed.
        predicted: the figures are the router's prediction; the engine's came too late for them.
        by_tier: cached tokens per tier, as reported (or predicted).
        details: the reason's particulars (see docs/router.md), in header order.
    """

    prompt_tokens: int
    cached_tokens: int
    reason: MissReason
    predicted: bool = False
    by_tier: dict[str, int] = field(default_factory=dict)
    details: dict[str, Detail] = field(default_factory=dict)

    @property
    def missed_tokens(self) -> int:
        """Prompt tokens not served from cache."""
        return max(0, self.prompt_tokens - self.cached_tokens)

    def header_value(self) -> str:
        """The ``x-kvmesh-cache`` value: ``key=value`` items separated by ``;``."""
        items = [
            f"cached={self.cached_tokens}",
            f"prompt={self.prompt_tokens}",
            f"reason={self.reason.value}",
        ]
        items += [f"{k}={_format(v)}" for k, v in self.details.items()]
        if self.by_tier:
            items.append("tiers=" + ",".join(f"{t}:{n}" for t, n in self.by_tier.items()))
        if self.predicted:
            items.append("predicted=1")
        return ";".join(items)


def _format(value: Detail) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


@dataclass(slots=True)
class MissFacts:
    """What the router knows about one answered request.

    Attributes:
        prompt_tokens: prompt tokens (the engine's count when it reported one).
        cached_tokens: what the engine served from cache, or the prediction when ``predicted``.
        pod: the endpoint that served it.
        router_block_size: the router's tokens per block.
        engine_block_size: the endpoint's engine tokens per block (the router's when unknown).
        prefix: the index match at decision time (``None``: no index).
        decision: the scheduler's decision.
        store_fault: the engine reported a failed store read.
        predicted: ``cached_tokens`` is the router's prediction.
        by_tier: cached tokens per tier.
    """

    prompt_tokens: int
    cached_tokens: int
    pod: PodId
    router_block_size: int
    engine_block_size: int
    prefix: PrefixMatch | None
    decision: Decision
    store_fault: bool = False
    predicted: bool = False
    by_tier: dict[str, int] = field(default_factory=dict)


def explain_miss(
    facts: MissFacts,
    *,
    seen: SeenBlocks,
    key_at: Callable[[int], BlockKey | None],
    tokenized_otherwise: Callable[[], bool],
    now: float,
    routed_at: float,
) -> CacheVerdict:
    """Decide the reason for ``facts``' miss.

    Args:
        facts: the request's figures.
        seen: the blocks the index held at some point.
        key_at: the router key of the prompt's block ``i`` (``None`` past its full blocks); called
            at most once, only when the memory of seen blocks is consulted.
        tokenized_otherwise: whether the prompt's leading text was tokenized into another first
            block before; called only when nothing else explains the miss.
        now: ``time.monotonic()``, for how long ago a block was removed.
        routed_at: ``time.monotonic()`` when the request was routed: blocks first seen later
            (the request's own, announced before its answer ended) do not count as seen.

    Returns:
        The verdict.
    """
    prompt, cached = facts.prompt_tokens, min(facts.cached_tokens, facts.prompt_tokens)
    verdict = CacheVerdict(prompt, cached, MissReason.NONE, facts.predicted, dict(facts.by_tier))
    if cached >= prompt:
        return verdict
    rbs, ebs = facts.router_block_size, facts.engine_block_size
    if ebs % rbs:
        verdict.reason = MissReason.BLOCK_SIZE_MISMATCH
        verdict.details.update(engine_block=ebs, router_block=rbs)
        return verdict
    if cached >= (prompt - 1) // ebs * ebs:
        verdict.reason = MissReason.PARTIAL_BLOCK
        verdict.details["missed"] = prompt - cached
        return verdict
    prefix, pod = facts.prefix, facts.pod
    held = 0 if prefix is None else prefix.hit_tokens(pod)
    if prefix is not None and _explain_routed(verdict, facts, prefix, max(held, cached)):
        return verdict
    if facts.store_fault:
        verdict.reason = MissReason.STORE_FAULT
        match = None if prefix is None else prefix.match_of(pod)
        if match is not None and held > cached:
            verdict.details["tier"] = _tier_at(match, cached // rbs).value
        return verdict
    if held > cached:
        # The index said the endpoint held it when the request was routed: it left meanwhile.
        match = prefix.match_of(pod) if prefix is not None else None
        verdict.reason = MissReason.EVICTED
        if match is not None:
            verdict.details["tier"] = _tier_at(match, cached // rbs).value
        verdict.details["lost"] = held - cached
        return verdict
    key = key_at(cached // rbs) if len(seen) else None
    sighting = None if key is None else seen.get(key)
    if sighting is not None and sighting.seen_before(routed_at):
        verdict.reason = MissReason.EVICTED
        verdict.details["tier"] = sighting.tier.value
        if routed_at > sighting.removed_at > 0:
            verdict.details["age_s"] = round(max(0.0, now - sighting.removed_at), 3)
        return verdict
    verdict.reason = MissReason.TOKENIZATION_DIFFERS if tokenized_otherwise() else MissReason.COLD
    return verdict


def _explain_routed(verdict: CacheVerdict, facts: MissFacts, prefix: PrefixMatch, got: int) -> bool:
    """Set ``routed_for_load`` when an endpoint other than the chosen one held more than ``got``:
    a candidate the scheduler's other terms passed over, or one its filters left out."""
    decision, pod = facts.decision, facts.pod
    scores = decision.scores
    holder: PodId | None = None
    best = got
    for other in (*scores, *(p for p in prefix.pods if p not in scores)):
        if other != pod:
            hit = prefix.hit_tokens(other)
            if hit > best:
                holder, best = other, hit
    if holder is None:
        return False
    verdict.reason = MissReason.ROUTED_FOR_LOAD
    verdict.details["by"] = best - got
    if holder not in scores:
        verdict.details["holder"] = "filtered"
        return True
    if pod in scores:
        verdict.details["score"] = scores[pod]
        verdict.details["holder_score"] = scores[holder]
    terms = decision.terms
    if terms is not None:
        mine, theirs = terms.of(pod), terms.of(holder)
        diffs = sorted(((mine[n] - theirs.get(n, 0.0), n) for n in mine), reverse=True)
        verdict.details["terms"] = ",".join(f"{_UNSAFE.sub('_', n)}:{d:+.3f}" for d, n in diffs if d)
    return True


_POSITION_ORDER = (Medium.GPU, Medium.CPU, Medium.DISK, Medium.SHARED)


def _tier_at(match: PodMatch, block: int) -> Medium:
    """The tier of a match's block ``block``, assuming faster tiers hold the earlier blocks (an
    engine's own tiers evict from the end, and the shared tier's run extends the own match)."""
    n = 0
    for tier in _POSITION_ORDER:
        n += match.blocks_by_tier.get(tier, 0)
        if block < n:
            return tier
    return max(match.blocks_by_tier, key=_POSITION_ORDER.index, default=Medium.GPU)
