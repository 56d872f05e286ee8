"""Per request: the ``x-kvmesh-cache`` header, the explain log, the reason counters, the usage ledger.

The gateway opens a :class:`CacheNote` when a request is routed; the proxy settles it with what
the engine reported::

    begin(routing, decision, tenant, texts)          at routing time: the text fingerprinted
    header_verdict(note, pod, engine figures|None)   header of the answer (a prediction when the
                                                     engine's figures are not known yet)
    finish(note, pod, engine figures|None)           at the end: the realized verdict, counted
                                                     (reasons, usage per tenant) and logged

``GET /admin/explain/{request_id}`` reads the log: the last ``explainHistory`` requests with
every endpoint's scores and predicted hits. Counters (at scrape time)::

    kvmesh_router_cache_requests_total{reason}       requests by miss reason
    kvmesh_router_cache_missed_tokens_total{reason}  prompt tokens not served from cache, by reason
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from kvmesh.core.cache_usage import CacheUsage
from kvmesh.core.hashing import as_token_array
from kvmesh.core.types import BlockKey, PodId
from kvmesh.router.cache_explain import CacheReportConfig, CacheVerdict, MissFacts, MissReason, explain_miss
from kvmesh.router.cache_memory import SeenBlocks, TextPrints, text_prints
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.prefix import iter_block_keys
from kvmesh.router.scheduler import Scheduler
from kvmesh.router.scrape_collector import ScrapeCollector
from kvmesh.router.types import Decision, PrefixMatch, RoutingRequest
from kvmesh.router.usage import UsageLedger


@dataclass(slots=True)
class CacheNote:
    """One routed request on its way through the proxy.

    Attributes:
        request_id: the client's ``x-request-id`` or the router's.
        tenant: the request's tenant.
        routing: what was routed (tokens, namespace, the index match); dropped once finished.
        decision: the scheduler's decision.
        texts: the prompt's text parts (empty for token-id prompts); dropped once finished.
        started: wall-clock time the request was routed.
        routed_at: the reporter's monotonic clock when the request was routed.
        pod: the endpoint that answered.
        header: the verdict sent in the answer's header.
        verdict: the final verdict (``None`` until finished).
        usage: the engine's figures, when it reported them.
    """

    request_id: str
    tenant: str
    routing: RoutingRequest | None
    decision: Decision
    texts: list[str] = field(default_factory=list)
    started: float = 0.0
    routed_at: float = 0.0
    pod: PodId | None = None
    header: CacheVerdict | None = None
    verdict: CacheVerdict | None = None
    usage: CacheUsage | None = None
    prints: tuple[list[bytes], bytes | None] | None = None
    """The text's fingerprints and the prompt's first block of token ids, once computed."""
    prompt_tokens: int = 0
    """The router's count of the prompt's tokens."""
    prefix: PrefixMatch | None = None
    """The index match the request was routed with."""


class CacheReporter:
    """Explains each request's cache use and counts it.

    Args:
        config: the bounds.
        scheduler: hashes prompts into router block keys (its hasher per namespace).
        engine_block_size: an endpoint's engine block size, ``None`` when unknown.
        memo: block keys already computed from event tokens (speeds up ``key_at``).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        config: CacheReportConfig,
        scheduler: Scheduler,
        engine_block_size: Callable[[PodId], int | None],
        *,
        memo: BlockKeyMemo | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.engine_block_size = engine_block_size
        self.memo = memo
        self.clock = clock
        self.seen = SeenBlocks(config.seen_blocks, clock)
        self.prints = TextPrints(config.text_prefixes)
        self.ledger = UsageLedger(config.max_tenants)
        self.requests_by_reason: dict[MissReason, int] = dict.fromkeys(MissReason, 0)
        self.missed_by_reason: dict[MissReason, int] = dict.fromkeys(MissReason, 0)
        self._log: OrderedDict[str, CacheNote] = OrderedDict()
        self._id_prefix = f"kvm-{secrets.token_hex(4)}-"
        self._ids = itertools.count()

    # ------------------------------------------------------------------ per request

    def request_id(self, given: str | None) -> str:
        """The client's request id, or a fresh one."""
        return given if given else f"{self._id_prefix}{next(self._ids)}"

    def begin(
        self, request_id: str, tenant: str, routing: RoutingRequest, decision: Decision, texts: list[str]
    ) -> CacheNote:
        """Open the note of a routed request; its text is fingerprinted now, the rest when it is
        settled."""
        note = CacheNote(request_id, tenant, routing, decision, texts, time.time(), self.clock())
        note.prompt_tokens, note.prefix = routing.num_tokens, routing.prefix
        # Every settled note needs the prints. Taken now, while the request's text is still in the
        # CPU's caches: at the answer, after other requests ran, the same work measured 2-3x slower.
        self._prints(note)
        return note

    def header_verdict(self, note: CacheNote, pod: PodId, usage: CacheUsage | None) -> CacheVerdict:
        """The verdict for the answer's header: from ``usage`` when the engine reported it before
        the answer starts, else the router's prediction (marked ``predicted``)."""
        note.pod = pod
        verdict = note.header = self._verdict(note, pod, usage)
        return verdict

    def finish(self, note: CacheNote, pod: PodId, usage: CacheUsage | None) -> CacheVerdict:
        """Settle ``note`` with the engine's figures: count, log and remember it.

        Args:
            note: the request.
            pod: the endpoint that answered.
            usage: the engine's figures (``None``: it reported none; the prediction stands).

        Returns:
            The final verdict.
        """
        note.pod = pod
        note.usage = usage
        verdict = note.verdict = self._verdict(note, pod, usage)
        if note.header is None:
            note.header = verdict
        self.requests_by_reason[verdict.reason] += 1
        self.missed_by_reason[verdict.reason] += verdict.missed_tokens
        self.ledger.add_request(
            note.tenant,
            prompt_tokens=verdict.prompt_tokens,
            cached_tokens=None if usage is None else verdict.cached_tokens,
            cached_by_tier=None if usage is None else usage.by_tier,
        )
        self._remember_text(note)
        # The log keeps figures, not the prompt.
        note.routing, note.texts = None, []
        log = self._log
        log.pop(note.request_id, None)
        log[note.request_id] = note
        while len(log) > self.config.explain_history:
            log.popitem(last=False)
        return verdict

    def _verdict(self, note: CacheNote, pod: PodId, usage: CacheUsage | None) -> CacheVerdict:
        routing = note.routing
        assert routing is not None, "a finished note was settled again"
        rbs = self.scheduler.block_size
        prefix = routing.prefix
        if usage is not None:
            prompt = usage.prompt_tokens if usage.prompt_tokens is not None else routing.num_tokens
            cached, by_tier, fault = usage.cached_tokens, usage.by_tier, usage.store_fault
        else:
            prompt, fault = routing.num_tokens, False
            cached = 0 if prefix is None else prefix.hit_tokens(pod)
            match = None if prefix is None else prefix.match_of(pod)
            by_tier = {} if match is None else {t.value: n * rbs for t, n in match.blocks_by_tier.items()}
        facts = MissFacts(
            prompt_tokens=prompt,
            cached_tokens=cached,
            pod=pod,
            router_block_size=rbs,
            engine_block_size=self.engine_block_size(pod) or rbs,
            prefix=prefix,
            decision=note.decision,
            store_fault=fault,
            predicted=usage is None,
            by_tier=dict(by_tier),
        )
        return explain_miss(
            facts,
            seen=self.seen,
            key_at=lambda i: self._key_at(routing, i),
            tokenized_otherwise=lambda: self._tokenized_otherwise(note),
            now=self.clock(),
            routed_at=note.routed_at,
        )

    def _key_at(self, routing: RoutingRequest, block: int) -> BlockKey | None:
        hasher = self.scheduler.hasher(routing.namespace)
        if block >= hasher.num_full_blocks(routing.num_tokens):
            return None
        keys = iter_block_keys(hasher, routing.tokens, self.memo)
        return next(itertools.islice(keys, block, None), None)

    def _prints(self, note: CacheNote) -> tuple[list[bytes], bytes | None]:
        if note.prints is None:
            routing = note.routing
            assert routing is not None, "a finished note was settled again"
            note.prints = ([], None)
            if note.texts and self.prints.capacity:  # without a memory the prints answer nothing
                hasher = self.scheduler.hasher(routing.namespace)
                prints = text_prints(hasher.root, note.texts)
                if prints and hasher.num_full_blocks(routing.num_tokens):
                    # The prints are seeded with the namespace: the first block's ids suffice.
                    note.prints = (prints, as_token_array(routing.tokens[: hasher.block_size]).tobytes())
        return note.prints

    def _tokenized_otherwise(self, note: CacheNote) -> bool:
        prints, first = self._prints(note)
        return first is not None and self.prints.tokenized_otherwise(prints, first)

    def _remember_text(self, note: CacheNote) -> None:
        prints, first = self._prints(note)
        if first is not None:
            self.prints.remember(prints, first)

    # ------------------------------------------------------------------ admin

    def explain(self, request_id: str) -> dict[str, Any] | None:
        """The log entry of ``request_id`` as JSON-ready dicts; ``None`` when not (or no longer) kept."""
        note = self._log.get(request_id)
        return None if note is None else _note_json(note)

    def recent(self, limit: int) -> list[dict[str, Any]]:
        """The latest ``limit`` requests, newest first, in brief."""
        out: list[dict[str, Any]] = []
        for note in reversed(self._log.values()):
            if len(out) >= limit:
                break
            verdict = note.verdict
            assert verdict is not None, "only finished notes are logged"
            out.append(
                {
                    "request_id": note.request_id,
                    "endpoint": note.pod,
                    "header": verdict.header_value(),
                    "at": note.started,
                }
            )
        return out


def _verdict_json(verdict: CacheVerdict | None) -> dict[str, Any] | None:
    if verdict is None:
        return None
    return {
        "reason": verdict.reason.value,
        "prompt_tokens": verdict.prompt_tokens,
        "cached_tokens": verdict.cached_tokens,
        "cached_by_tier": verdict.by_tier,
        "predicted": verdict.predicted,
        "details": verdict.details,
        "header": verdict.header_value(),
    }


def _note_json(note: CacheNote) -> dict[str, Any]:
    decision, prefix = note.decision, note.prefix
    terms = decision.terms
    endpoints = []
    for pod, score in decision.scores.items():
        hit, by_tier = 0, {}
        match = None if prefix is None else prefix.match_of(pod)
        if prefix is not None and match is not None:
            hit = prefix.hit_tokens(pod)
            by_tier = {t.value: n * prefix.block_size for t, n in match.blocks_by_tier.items()}
        endpoints.append(
            {
                "endpoint": pod,
                "chosen": pod == note.pod,
                "score": score,
                "terms": {} if terms is None else terms.of(pod),
                "predicted_hit_tokens": hit,
                "predicted_by_tier": by_tier,
            }
        )
    return {
        "request_id": note.request_id,
        "time": note.started,
        "tenant": note.tenant,
        "endpoint": note.pod,
        "profile": decision.profile,
        "ranked": decision.ranked,
        "prompt_tokens": note.prompt_tokens,
        "predicted_hit_tokens": 0 if prefix is None or note.pod is None else prefix.hit_tokens(note.pod),
        "engine_reported": note.usage is not None,
        "sent_header": _verdict_json(note.header),
        "verdict": _verdict_json(note.verdict),
        "endpoints": endpoints,
    }


class CacheReasonCollector(ScrapeCollector[tuple[Mapping[MissReason, int], Mapping[MissReason, int]]]):
    """Exports a :class:`CacheReporter`'s counts by reason at scrape time."""

    def collect(self) -> Iterator[Metric]:
        requests, missed = self._source()
        by_requests = CounterMetricFamily(
            "kvmesh_router_cache_requests", "Answered requests by cache miss reason", labels=["reason"]
        )
        by_tokens = CounterMetricFamily(
            "kvmesh_router_cache_missed_tokens",
            "Prompt tokens not served from cache, by miss reason",
            labels=["reason"],
        )
        for reason in MissReason:
            by_requests.add_metric([reason.value], requests.get(reason, 0))
            by_tokens.add_metric([reason.value], missed.get(reason, 0))
        yield by_requests
        yield by_tokens
