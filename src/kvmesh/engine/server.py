# Over 450 lines: the two generation routes share one request path (validation, admission, streaming, usage, P/D transfer fields); the describing routes live in info_api and peer_api.
"""OpenAI-compatible HTTP server of one engine (aiohttp).

Routes::

    POST /v1/completions             prompt text, token ids, or a batch of either (batch: non-streaming)
    POST /v1/chat/completions        messages rendered with the model's chat template
    GET  /v1/models   GET /health   POST /tokenize   POST /detokenize   GET /metrics
    GET  /kvmesh/info                what a router needs to find this engine's event stream
    GET  /version   POST /reset_prefix_cache
    GET  /model_info   GET /server_info   POST /v1/completions/render   ...   what SGLang's and vLLM's
                                     routers read from a worker (:mod:`kvmesh.engine.peer_api`)

Bad input gets OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status. A client that goes away (stream or not) cancels its request, which frees its batch slot
and unpins its blocks. Streams send the first token as soon as it exists; later tokens may be
coalesced every ``stream_interval`` seconds so one small machine can host many emulated engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from kvmesh.core.cache_usage import ENGINE_CACHED_HEADER, CacheUsage
from kvmesh.core.pins import KVMESH_FIELD
from kvmesh.core.tenancy import Role, resolve_tenant
from kvmesh.core.tokens import Tokenizer
from kvmesh.engine.agent_api import AgentApi, AgentFrames
from kvmesh.engine.core import EngineCore
from kvmesh.engine.detokenizer import StopMatcher, StreamDetokenizer
from kvmesh.engine.facts import EngineFacts
from kvmesh.engine.info_api import InfoApi
from kvmesh.engine.metrics import EngineMetrics
from kvmesh.engine.peer_api import PeerApi
from kvmesh.engine.pins import admit_pin, refusal_error
from kvmesh.engine.prompt_input import chat_input, completion_input, request_limits
from kvmesh.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    request_role,
    sampling_params,
    stop_strings,
)
from kvmesh.engine.request import EngineRequest
from kvmesh.errors import RequestError

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class ServerConfig:
    """What the server reports and how it streams."""

    served_model_name: str
    model_aliases: tuple[str, ...] = ()
    role: Role = Role.BOTH
    stream_interval: float = 0.0
    """Seconds between stream flushes after the first token (0: every step)."""
    poll_interval: float = 0.25
    """How often a waiting handler checks that its client is still connected."""
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    events_topic: str | None = None
    """First frame of the event messages (``None`` when there is no event stream)."""
    hash_algo: str = "sha256"
    revision: str = ""
    emulate: str | None = None
    model_path: str = ""
    """Directory the model (emulated: its tokenizer) was loaded from; empty when given in-process."""
    extra_info: dict[str, Any] = field(default_factory=dict)


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 409: "ConflictError",
            413: "RequestTooLarge", 429: "RateLimitError", 503: "ServiceUnavailableError"}  # fmt: skip
    body = {"error": {"message": message, "type": kind.get(status, "InternalServerError"), "param": param,
                      "code": status}}  # fmt: skip
    return web.Response(status=status, body=_json.encode(body), content_type="application/json")


def _ok(body: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(body), content_type="application/json")


@dataclass(slots=True)
class _Choice:
    """One prompt of a request, as it runs."""

    index: int
    req: EngineRequest
    detok: StreamDetokenizer
    stop: StopMatcher
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None


class EngineServer:
    """The HTTP face of an :class:`EngineCore`.

    Args:
        core: the engine core (started and stopped with the server).
        tokenizer: the model's tokenizer.
        config: names, role and streaming behaviour.
    """

    def __init__(self, core: EngineCore, tokenizer: Tokenizer, config: ServerConfig) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.config = config
        info = core.runner.info
        self.facts = EngineFacts(
            served_model_name=config.served_model_name,
            model_path=config.model_path or config.served_model_name,
            revision=config.revision,
            block_size=core.cache.block_size,
            hash_algo=config.hash_algo,
            events_endpoint=config.events_endpoint,
            replay_endpoint=config.replay_endpoint,
            events_topic=config.events_topic,
            role=config.role,
            kv_layout=info.kv.name(),
            kv_dtype=info.kv.dtype,
            kv_bytes_per_token=info.kv.bytes_per_token,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            prompt_vocab_size=min(info.vocab_size, tokenizer.vocab_size)
            if tokenizer.vocab_size
            else info.vocab_size,
            num_blocks=core.cache.capacity_blocks,
            max_num_seqs=core.config.max_num_seqs,
            max_num_batched_tokens=core.config.max_num_batched_tokens,
            emulate=config.emulate,
            device=info.device,
            has_store=core.has_store,
            extra_info=dict(config.extra_info),
        )
        self.max_model_len = self.facts.max_model_len
        self.vocab_size = self.facts.prompt_vocab_size
        self.metrics = EngineMetrics(core, config.served_model_name)
        self.app = web.Application(client_max_size=64 * 2**20, middlewares=[self._errors])
        r = self.app.router
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        InfoApi(self, self.metrics, core).register(r)
        PeerApi(self).register(r)
        AgentApi(self).register(r)
        self._runner: web.AppRunner | None = None
        self.host = ""
        self.port = 0
        self._names = {config.served_model_name, *config.model_aliases}

    # ---------------------------------------------------------------- lifecycle

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Start the engine core and listen; returns the bound port (``port=0`` picks one)."""
        await self.core.start()
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        server = site._server
        assert server is not None, "TCPSite.start() left no server"
        sockets = getattr(server, "sockets", None) or []
        self.host = host
        self.port = int(sockets[0].getsockname()[1]) if sockets else port
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        """Stop listening, then stop the engine core."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.core.aclose()

    # ---------------------------------------------------------------- plumbing

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "?"
        try:
            response = await handler(request)
        except RequestError as exc:
            response = _error(exc.status, exc.message, exc.param)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = _error(exc.status, exc.reason or exc.text or "error")
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            logger.exception("unhandled error on %s", request.path)
            response = _error(500, f"internal error: {type(exc).__name__}: {exc}")
        self.metrics.observe_http(route, response.status)
        return response

    def check_model(self, model: str | None) -> None:
        """Raise a 404 :class:`RequestError` unless ``model`` is ``None`` or a name this engine serves."""
        if model is not None and model not in self._names:
            raise RequestError(
                f"The model `{model}` does not exist. Served: {self.config.served_model_name}",
                status=404,
                param="model",
            )

    @staticmethod
    def _client_gone(request: web.Request) -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    # ---------------------------------------------------------------- generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, ids_list = await completion_input(self, await request.read())
        return await self._generate(request, body, ids_list, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body, ids = await chat_input(self, await request.read())
        return await self._generate(request, body, [ids], chat=True)

    async def generate_chat(
        self, request: web.Request, body: ChatCompletionRequest, ids: list[int], frames: AgentFrames
    ) -> web.StreamResponse:
        """Run one chat prompt's ``ids`` and answer in ``frames``' API shape (``/v1/responses``,
        ``/v1/messages``)."""
        return await self._generate(request, body, [ids], chat=True, frames=frames)

    async def _generate(
        self,
        request: web.Request,
        body: CompletionRequest | ChatCompletionRequest,
        ids_list: list[list[int]],
        *,
        chat: bool,
        frames: AgentFrames | None = None,
    ) -> web.StreamResponse:
        arrival = time.monotonic()
        limits = request_limits(self.facts, chat=chat)
        role = request_role(body, self.config.role)
        stops = stop_strings(body)
        params = [sampling_params(body, len(ids), limits) for ids in ids_list]
        if role is Role.PREFILL:
            for p in params:
                p.max_tokens = 1
        tenant = resolve_tenant(request.headers, body.cache_salt)
        pin_ttl_s = await admit_pin(
            self.core.store_sync.store,
            request.headers,
            {KVMESH_FIELD: body.kvmesh, "kv_transfer_params": body.kv_transfer_params},
            ids_list,
            tenant,
        )
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        choices: list[_Choice] = []
        try:
            for i, (ids, sp) in enumerate(zip(ids_list, params, strict=True)):
                req = EngineRequest(f"{rid}-{i}", ids, sp, tenant=tenant, role=role, arrival_time=arrival)
                req.pin_ttl_s = pin_ttl_s
                choices.append(_Choice(i, req, StreamDetokenizer(self.tokenizer), StopMatcher(stops)))
            await asyncio.gather(*(self.core.add_request(c.req) for c in choices))
            if body.stream:
                return await self._stream(request, body, rid, choices[0], chat=chat, frames=frames)
            return await self._collect(request, body, rid, choices, chat=chat, frames=frames)
        finally:
            for c in choices:
                self.core.abort(c.req.request_id)

    def _apply(self, choice: _Choice, token_ids: list[int], finish_reason: str | None) -> str:
        """Turn new tokens into text, applying stop strings; sets ``finish_reason`` when done."""
        eos = set(self.core.runner.info.eos_token_ids) | set(choice.req.seq.sampling.stop_token_ids)
        visible = [t for t in token_ids if t not in eos]
        text = choice.detok.push(visible) if visible else ""
        if finish_reason is not None:
            text += choice.detok.flush()
        text = choice.stop.feed(text, final=finish_reason is not None)
        if choice.stop.stopped:
            choice.finish_reason = "stop"
            self.core.abort(choice.req.request_id)
        elif finish_reason is not None:
            choice.finish_reason = "stop" if finish_reason == "abort" else finish_reason
        choice.text.append(text)
        return text

    def _observe(self, choice: _Choice) -> None:
        req = choice.req
        now = time.monotonic()
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        self.metrics.observe_request(ttft, now - req.arrival_time, choice.finish_reason, req.token_gaps)

    async def _next(self, request: web.Request, choice: _Choice) -> tuple[list[int], str | None] | None:
        """Wait for the next outputs of ``choice``; ``None`` if the client disconnected meanwhile."""
        while True:
            out = await choice.req.next_output(self.config.poll_interval)
            if out is not None:
                break
            if self._client_gone(request):
                return None
        outs = [out, *choice.req.drain_outputs()]
        tokens = [t for o in outs for t in o.new_token_ids]
        reason = next((o.finish_reason for o in outs if o.finished), None)
        return tokens, reason

    async def _collect(
        self,
        request: web.Request,
        body: CompletionRequest | ChatCompletionRequest,
        rid: str,
        choices: list[_Choice],
        *,
        chat: bool,
        frames: AgentFrames | None = None,
    ) -> web.StreamResponse:
        for choice in choices:
            while choice.finish_reason is None:
                got = await self._next(request, choice)
                if got is None:
                    return web.Response(status=499)
                tokens, reason = got
                if reason == "error":
                    raise RuntimeError(f"engine failed request {choice.req.request_id}")
                self._apply(choice, tokens, reason)
            await self._maybe_wait_store(choice)
            if choice.req.role is Role.PREFILL and choice.req.pin_results:
                # The prompt is stored but another engine's pin took the budget meanwhile.
                refused = refusal_error(choice.req.pin_results)
                if refused is not None:
                    raise refused
            self._observe(choice)
        out_choices = []
        for c in choices:
            text = "".join(c.text)
            if chat:
                out_choices.append(
                    {"index": c.index, "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": c.finish_reason}
                )  # fmt: skip
            else:
                out_choices.append(
                    {"index": c.index, "text": text, "logprobs": None, "finish_reason": c.finish_reason}
                )
        result: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.served_model_name,
            "choices": out_choices,
            "usage": self._usage(choices),
        }
        transfer = self._transfer_params(choices[0])
        if transfer is not None:
            result["kv_transfer_params"] = transfer
        return _ok(result if frames is None else frames.complete(result))

    async def _maybe_wait_store(self, choice: _Choice) -> None:
        """A prefill-role request returns only once its KV is in the store."""
        done = choice.req.store_done
        if choice.req.role is Role.PREFILL and done is not None:
            await asyncio.shield(done)

    def _transfer_params(self, choice: _Choice) -> dict[str, Any] | None:
        req = choice.req
        if req.role is Role.BOTH:
            return None
        params = {"role": req.role.value, "num_prompt_tokens": req.num_prompt_tokens,
                  "num_cached_tokens": req.num_reported_cached_tokens or 0, "cached_tier": req.cached_tier}  # fmt: skip
        if req.pin_results is not None:
            params["kvmesh_pins"] = [r.to_dict() for r in req.pin_results]
        return params

    @staticmethod
    def _usage(choices: list[_Choice]) -> dict[str, Any]:
        prompt = sum(c.req.num_prompt_tokens for c in choices)
        completion = sum(c.req.num_output_tokens for c in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": _cache_usage(choices).usage_details(),
        }

    async def _stream(
        self,
        request: web.Request,
        body: CompletionRequest | ChatCompletionRequest,
        rid: str,
        choice: _Choice,
        *,
        chat: bool,
        frames: AgentFrames | None = None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": rid}
        )
        created = int(time.time())
        model = self.config.served_model_name
        kind = "chat.completion.chunk" if chat else "text_completion"
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        interval = self.config.stream_interval
        first = True
        last_flush = 0.0
        try:
            while choice.finish_reason is None:
                got = await self._next(request, choice)
                if got is None:
                    return resp if resp.prepared else web.Response(status=499)
                tokens, reason = got
                if first:
                    # Prepared only now: with the first token the request was admitted, so the
                    # headers can say what its prompt found cached.
                    resp.headers[ENGINE_CACHED_HEADER] = _cache_usage([choice]).header_value()
                    await resp.prepare(request)
                if not first and interval > 0 and reason is None:
                    wait = last_flush + interval - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                        more = choice.req.drain_outputs()
                        tokens += [t for o in more for t in o.new_token_ids]
                        reason = next((o.finish_reason for o in more if o.finished), None)
                if reason == "error":
                    raise RuntimeError(f"engine failed request {choice.req.request_id}")
                text = self._apply(choice, tokens, reason)
                if frames is not None:
                    if first:
                        await resp.write(frames.opening(self._usage([choice])))
                    await resp.write(frames.delta(text))
                    first = False
                    last_flush = time.monotonic()
                    continue
                if chat:
                    delta: dict[str, Any] = {"content": text}
                    if first:
                        delta = {"role": "assistant", "content": text}
                    payload = {
                        "index": 0,
                        "delta": delta,
                        "logprobs": None,
                        "finish_reason": choice.finish_reason,
                    }
                else:
                    payload = {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": choice.finish_reason,
                    }
                chunk: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model,
                                         "choices": [payload]}  # fmt: skip
                if choice.finish_reason is not None:
                    await self._maybe_wait_store(choice)
                    transfer = self._transfer_params(choice)
                    if transfer is not None:
                        chunk["kv_transfer_params"] = transfer
                await resp.write(b"data: " + _json.encode(chunk) + b"\n\n")
                first = False
                last_flush = time.monotonic()
            self._observe(choice)
            if frames is not None:
                await self._maybe_wait_store(choice)
                await resp.write(frames.closing(choice.finish_reason, self._usage([choice])))
                await resp.write_eof()
                return resp
            if include_usage:
                usage = {"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                         "usage": self._usage([choice])}  # fmt: skip
                await resp.write(b"data: " + _json.encode(usage) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            # The client left; the finally clause of _generate cancels the request.
            pass
        return resp

    def info_dict(self) -> dict[str, Any]:
        """The ``/kvmesh/info`` document."""
        return self.facts.info_dict()


def _cache_usage(choices: list[_Choice]) -> CacheUsage:
    """The cache figures of ``choices``' prompts, summed."""
    by_tier: dict[str, int] = {}
    for c in choices:
        for tier, n in c.req.reported_cached_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    return CacheUsage(
        cached_tokens=sum(c.req.num_reported_cached_tokens or 0 for c in choices),
        prompt_tokens=sum(c.req.num_prompt_tokens for c in choices),
        by_tier=by_tier,
        store_fault=any(c.req.store_fault for c in choices),
    )


async def serve_forever(server: EngineServer, host: str, port: int, ready: Callable[[int], None]) -> None:
    """Run ``server`` until cancelled (SIGINT/SIGTERM in the CLI)."""
    bound = await server.start(host, port)
    ready(bound)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
    finally:
        await server.stop()
