"""``POST /v1/kvmesh/prewarm``: compute documents' KV once, so that every endpoint serves them from cache.

Per document (at most ``concurrency`` at once)::

    document ─► completions/chat body ─► RequestParser (the tokens a request would get)
             ─► Scheduler.match: the fleet holds it all already? ─► "cached", nothing sent
             ─► Scheduler.pick ─► the endpoint computes the prompt, no decode:
                    kvmesh engine: kv_transfer_params {"role": "prefill"} (answers once the KV is stored)
                    other (vLLM + KVMeshConnector): max_tokens 1
             ─► wait until the shared tier holds the prompt's whole store chunks, as announced to
                the router (SHARED blocks of its chain in the index), up to ``timeout_s``

vLLM publishes KV events only from its step loop, so while waiting on an endpoint that is not a
kvmesh engine the router sends it a one-token request now and then; the event of a finished save
rides out on that step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web

from kvmesh.core.types import Medium, PodId
from kvmesh.errors import RequestError, TierUnavailableError
from kvmesh.router.prefill_leg import prefill_body
from kvmesh.router.prewarm_request import (
    PrewarmDocument,
    PrewarmPlan,
    PrewarmResponse,
    PrewarmResult,
    parse_prewarm_body,
    summarize,
)
from kvmesh.router.replies import error_response
from kvmesh.router.request_parser import ParsedRequest
from kvmesh.router.types import Decision, PrefixMatch, RoutingRequest

if TYPE_CHECKING:
    from kvmesh.router.gateway import Gateway

logger = logging.getLogger(__name__)

PREWARM_PATH = "/v1/kvmesh/prewarm"
POLL_INTERVAL_S = 0.1
"""How often the index is read while waiting for a document's shared-tier announcement."""
NUDGE_INTERVAL_S = 1.0
"""How often an endpoint that publishes events only from its step loop gets a one-token request."""
_FORWARD_HEADERS = ("authorization", "x-request-id")


def tiers_of(match: PrefixMatch) -> dict[str, int]:
    """Blocks of the prompt held per tier: the most any one endpoint holds in its own tiers, and
    the shared tier's run from the prompt's start."""
    tiers: dict[str, int] = {}
    for pod in match.pods.values():
        for tier, n in pod.blocks_by_tier.items():
            if tier is not Medium.SHARED and n > tiers.get(tier.value, 0):
                tiers[tier.value] = n
    if match.shared is not None:
        tiers[Medium.SHARED.value] = match.shared.num_blocks
    return tiers


def shared_blocks(match: PrefixMatch) -> int:
    """Blocks of the prompt the shared tier holds from its start (as the router knows it)."""
    return 0 if match.shared is None else match.shared.num_blocks


class Prewarmer:
    """Runs prewarm requests against one gateway's pool, index and scheduler.

    Args:
        gateway: the gateway whose parser, scheduler, pool and prefill ledger are used.
    """

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def parse(self, plan: PrewarmPlan, headers: Mapping[str, str]) -> list[ParsedRequest]:
        """Each document as the request the gateway would route (tokenized like one).

        Raises:
            RequestError: a document (or the tenant) is invalid, or text needs a tokenizer the
                router does not have.
        """
        gw = self.gateway
        if gw.tokenizer is None and any(
            doc.chat or isinstance(doc.body["prompt"], str) for doc in plan.documents
        ):
            raise RequestError(
                "the router has no tokenizer (start it with --tokenizer), so it can prewarm only "
                "'prompt_token_ids' documents",
                param="documents",
            )
        parsed = []
        for i, doc in enumerate(plan.documents):
            try:
                parsed.append(
                    await gw.parser.parse(
                        msgspec.json.encode(doc.body), headers, chat=doc.chat, model=gw.model,
                        revision=gw.revision,
                    )
                )  # fmt: skip
            except RequestError as exc:
                raise RequestError(f"documents[{i}] ({doc.id!r}): {exc.message}", param="documents") from exc
        return parsed

    async def run(
        self, plan: PrewarmPlan, parsed: list[ParsedRequest], headers: Mapping[str, str]
    ) -> list[PrewarmResult]:
        """Prewarm every document of ``plan``; results in the documents' order."""
        forward = {k: v for k, v in headers.items() if k.lower() in _FORWARD_HEADERS}
        forward["Content-Type"] = "application/json"
        slots = asyncio.Semaphore(plan.concurrency)
        timeout = aiohttp.ClientTimeout(total=self.gateway.config.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def one(doc: PrewarmDocument, req: ParsedRequest) -> PrewarmResult:
                async with slots:
                    return await self._prewarm(plan, doc, req, session, forward)

            return list(
                await asyncio.gather(*(one(d, p) for d, p in zip(plan.documents, parsed, strict=True)))
            )

    async def _prewarm(
        self,
        plan: PrewarmPlan,
        doc: PrewarmDocument,
        req: ParsedRequest,
        session: aiohttp.ClientSession,
        headers: dict[str, str],
    ) -> PrewarmResult:
        started = time.perf_counter()
        routing = req.routing
        before = await self._match(routing)
        bs = before.block_size
        chunk = plan.store_chunk_tokens
        target_blocks = routing.num_tokens // chunk * chunk // bs
        cached = before.longest_blocks()
        result = PrewarmResult(
            id=doc.id,
            status="prewarmed",
            tokens=routing.num_tokens,
            blocks=before.num_blocks,
            blocks_cached=cached,
            blocks_new=before.num_blocks - cached,
            tiers_before=tiers_of(before),
            shared_target_tokens=target_blocks * bs,
        )
        waits = plan.wait_for_shared and target_blocks > 0
        held = shared_blocks(before) >= target_blocks if waits else 0 < before.num_blocks <= cached
        if held and req.pin_ttl_s is None:
            # a pin is still sent: the engine finds the prefix cached and pins (or extends) it
            return self._finish(result, before, "cached", started, target_blocks)
        routing.prefix = before
        decision = self._pick(routing)
        if decision is None:
            result.error = "no healthy endpoint can compute it"
            return self._finish(result, before, "failed", started, target_blocks)
        pod = await self._compute(doc, req, decision, session, headers, result)
        if pod is None:
            return self._finish(result, await self._match(routing), "failed", started, target_blocks)
        if req.pin_ttl_s is not None:
            gw = self.gateway
            gw.pinned.pin(gw.scheduler.hasher(routing.namespace).hash_blocks(routing.tokens), req.pin_ttl_s)
        hit = result.engine_cached_tokens if result.engine_cached_tokens is not None else cached * bs
        self.gateway.cache_report.ledger.add_prewarmed(req.tenant, max(routing.num_tokens - hit, 0))
        if not waits:
            return self._finish(result, await self._match(routing), "prewarmed", started, target_blocks)
        after = await self._wait_shared(doc, routing, target_blocks, pod, session, headers, plan.timeout_s)
        status = "prewarmed" if shared_blocks(after) >= target_blocks else "timeout"
        if status == "timeout":
            result.error = (
                f"the shared tier held {shared_blocks(after) * bs} of {target_blocks * bs} tokens "
                f"after {plan.timeout_s:g}s (is a shared store tier configured, and are its writes announced?)"
            )
        return self._finish(result, after, status, started, target_blocks)

    @staticmethod
    def _finish(
        result: PrewarmResult, match: PrefixMatch, status: str, started: float, target_blocks: int
    ) -> PrewarmResult:
        result.status = status
        result.tiers = tiers_of(match)
        result.shared_tokens = shared_blocks(match) * match.block_size
        result.reached_shared = target_blocks > 0 and shared_blocks(match) >= target_blocks
        result.seconds = round(time.perf_counter() - started, 3)
        return result

    async def _match(self, routing: RoutingRequest) -> PrefixMatch:
        """The index's match, read on a worker thread for a remote index (empty when unreachable)."""
        gw = self.gateway
        try:
            if gw.index_is_remote:
                return await asyncio.to_thread(gw.scheduler.match, routing)
            return gw.scheduler.match(routing)
        except TierUnavailableError as exc:
            logger.warning("index unavailable during prewarm: %s", exc)
            hasher = gw.scheduler.hasher(routing.namespace)
            return PrefixMatch(hasher.num_full_blocks(routing.num_tokens), gw.config.block_size)

    def _pick(self, routing: RoutingRequest) -> Decision | None:
        gw = self.gateway
        assert gw.pool is not None, "prewarm before Gateway.start()"
        gw.prefill_ledger.refresh(time.perf_counter())
        return gw.scheduler.pick(routing, gw.pool.states())

    async def _compute(
        self,
        doc: PrewarmDocument,
        req: ParsedRequest,
        decision: Decision,
        session: aiohttp.ClientSession,
        headers: dict[str, str],
        result: PrewarmResult,
    ) -> PodId | None:
        """Have the chosen endpoint (or, when it cannot be reached, the next ones) compute the
        prompt; returns the endpoint that did, or ``None`` with ``result.error`` set."""
        gw = self.gateway
        pool = gw.pool
        assert pool is not None, "prewarm before Gateway.start()"
        first = decision.prefill if decision.prefill is not None else decision.endpoint
        order = [first, *(p for p in decision.ranked if p != first)][: gw.config.max_attempts]
        routing = req.routing
        rid = f"prewarm-{routing.request_id}"
        for pod in order:
            endpoint = pool.get(pod)
            if endpoint is None or (pod != first and not endpoint.state.healthy):
                continue
            # A kvmesh engine (it answered /kvmesh/info) returns a prefill-role request once the
            # KV is stored; other engines compute the prompt for one output token.
            body = prefill_role_body(req.body) if endpoint.info is not None else one_token_body(req.body)
            hit = routing.prefix.hit_tokens(pod) if routing.prefix is not None else 0
            pool.begin_request(pod)
            gw.prefill_ledger.sent(
                rid, endpoint.state, routing.num_tokens - hit, time.perf_counter(), cached=hit
            )
            try:
                async with session.post(
                    f"{pod}{doc.path}", data=msgspec.json.encode(body), headers=headers
                ) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        result.endpoint = pod
                        result.error = f"{pod} answered {resp.status}: {raw[:300].decode(errors='replace')}"
                        return None
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
                pool.report_failure(pod, str(exc))
                result.error = f"{pod}: {exc}"
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                result.endpoint = pod
                result.error = f"{pod} failed: {exc or type(exc).__name__}"
                return None
            finally:
                pool.end_request(pod)
                gw.prefill_ledger.finished(rid)
            result.endpoint = pod
            result.error = None
            result.engine_cached_tokens = _cached_tokens(raw)
            return pod
        if result.error is None:
            result.error = "no endpoint could be reached"
        return None

    async def _wait_shared(
        self,
        doc: PrewarmDocument,
        routing: RoutingRequest,
        target_blocks: int,
        pod: PodId,
        session: aiohttp.ClientSession,
        headers: dict[str, str],
        timeout_s: float,
    ) -> PrefixMatch:
        """Read the index until the shared tier holds ``target_blocks`` of the prompt, or time out;
        returns the last match."""
        pool = self.gateway.pool
        assert pool is not None, "prewarm before Gateway.start()"
        endpoint = pool.get(pod)
        nudges = endpoint is not None and endpoint.info is None
        deadline = time.monotonic() + timeout_s
        next_nudge = time.monotonic() + NUDGE_INTERVAL_S
        while True:
            match = await self._match(routing)
            now = time.monotonic()
            if shared_blocks(match) >= target_blocks or now >= deadline:
                return match
            if nudges and now >= next_nudge:
                await self._nudge(doc, routing, pod, session, headers)
                next_nudge = time.monotonic() + NUDGE_INTERVAL_S
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _nudge(
        self,
        doc: PrewarmDocument,
        routing: RoutingRequest,
        pod: PodId,
        session: aiohttp.ClientSession,
        headers: dict[str, str],
    ) -> None:
        """One step on ``pod`` (a one-token prompt), whose output carries its pending KV events."""
        body: dict[str, Any] = {"prompt": [int(routing.tokens[0])], "max_tokens": 1, "temperature": 0}
        if "model" in doc.body:
            body["model"] = doc.body["model"]
        try:
            async with session.post(
                f"{pod}/v1/completions", data=msgspec.json.encode(body), headers=headers
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.info("prewarm: nudging %s failed: %s", pod, exc)


def prefill_role_body(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as a P/D prefill leg, keeping the ``kv_transfer_params`` it already carries (a pin's
    TTL, for one) next to the prefill role."""
    out = prefill_body(body)
    given = body.get("kv_transfer_params")
    if isinstance(given, dict):
        out["kv_transfer_params"] = {**given, **out["kv_transfer_params"]}
    return out


def one_token_body(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` cut to one greedy, unstreamed output token (the prompt is computed, nothing decoded)."""
    out = dict(body)
    out.update(stream=False, max_tokens=1, temperature=0)
    return out


def _cached_tokens(raw: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an OpenAI answer, when it has one."""
    try:
        usage = msgspec.json.decode(raw).get("usage") or {}
        value = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (msgspec.DecodeError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class PrewarmApi:
    """The prewarm route of one gateway.

    Args:
        gateway: the gateway it prewarms through.
    """

    def __init__(self, gateway: Gateway) -> None:
        self.prewarmer = Prewarmer(gateway)
        self.gateway = gateway

    def register(self, app: web.Application) -> None:
        """Add ``POST /v1/kvmesh/prewarm`` to ``app``."""
        app.router.add_post(PREWARM_PATH, self._prewarm)

    async def _prewarm(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"request body larger than {self.gateway.config.max_body_bytes} bytes")
        try:
            plan = parse_prewarm_body(raw)
            parsed = await self.prewarmer.parse(plan, request.headers)
        except RequestError as exc:
            self.gateway.metrics.errors.labels("bad_request").inc()
            return error_response(exc.status, exc.message, param=exc.param)
        results = await self.prewarmer.run(plan, parsed, request.headers)
        body = PrewarmResponse(documents=results, summary=summarize(results, time.perf_counter() - started))
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")
