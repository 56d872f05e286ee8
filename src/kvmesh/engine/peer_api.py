"""What SGLang's and vLLM's routers read from a worker, answered by a kvmesh engine.

Both routers register and route to a kvmesh engine unchanged once it answers these:

- **sglang-router** (0.3) probes ``GET /health``, then registers the worker from ``GET /server_info``
  and ``GET /model_info``: the worker's model id is ``served_model_name`` (else ``model_path``), and
  its tokenizer is loaded from ``model_path``. A worker with neither is model ``unknown``.
- **vllm-router** (0.1) asks *every* worker, for every request its ``cache_aware`` or ``kv_aware``
  policy routes, for the prompt ids that worker would compute (``POST /v1/completions/render``,
  ``POST /v1/chat/completions/render``; ``POST /tokenize`` where render answers 404). ``kv_aware``
  finds a worker's KV event stream from ``GET /get_server_info`` and ``GET /kv_event_sources``
  unless ``--kv-event-source`` names it; P/D mode reads ``vllm_config.model_config.model`` and
  ``vllm_config.cache_config.block_size`` from ``GET /server_info?config_format=json``.

Routes::

    GET  /model_info                    kvmesh's model facts + SGLang's (model_path, tokenizer_path,
                                        served_model_name, is_generation)
    GET  /server_info[?config_format=]  /kvmesh/info + SGLang's server arguments + vLLM's vllm_config
                                        (a dict with config_format=json, text otherwise, as vLLM)
    GET  /get_server_info               /server_info + vllm-router's model_id and instance_id
    GET  /get_model_info                /model_info (SGLang's older name)
    GET  /kv_event_sources              the KV event stream per data-parallel rank ({} without one)
    POST /v1/completions/render         [{request_id, token_ids, sampling_params, model, ...}] per prompt
    POST /v1/chat/completions/render    {request_id, token_ids, sampling_params, model, ...}

A render validates exactly what generation would (model name, prompt shape, token ids, context
length, sampling fields) and answers the same 4xx with a message; it generates nothing.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from aiohttp import web

from kvmesh.engine.facts import ServedModel
from kvmesh.engine.prompt_input import chat_input, completion_input, request_limits
from kvmesh.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    sampling_params,
    stop_strings,
)
from kvmesh.errors import RequestError

_json = msgspec.json.Encoder()
CONFIG_FORMATS = ("text", "json")
EVENT_HWM = 100_000
"""The publisher's ZMQ send high-water mark, reported to subscribers."""


def _ok(body: Any) -> web.Response:
    return web.Response(body=_json.encode(body), content_type="application/json")


class PeerApi:
    """The peer-router routes of one engine (see the module docstring).

    Args:
        model: the engine whose facts the documents describe and whose tokenizer renders prompts.
    """

    def __init__(self, model: ServedModel) -> None:
        self.model = model
        self.instance_id = uuid.uuid4().hex
        """Changes with every engine process, so a router can tell a restart from a stall."""

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_get("/model_info", self.model_info)
        router.add_get("/get_model_info", self.model_info)
        router.add_get("/server_info", self.server_info)
        router.add_get("/get_server_info", self.get_server_info)
        router.add_get("/kv_event_sources", self.kv_event_sources)
        router.add_post("/v1/completions/render", self.render_completion)
        router.add_post("/v1/chat/completions/render", self.render_chat)

    # ---------------------------------------------------------------- documents

    def model_info_dict(self) -> dict[str, Any]:
        """The ``/model_info`` document."""
        facts = self.model.facts
        return {
            "model": facts.served_model_name,
            "max_model_len": facts.max_model_len,
            "vocab_size": facts.vocab_size,
            "block_size": facts.block_size,
            "kv_layout": facts.kv_layout,
            "kv_dtype": facts.kv_dtype,
            "model_path": facts.model_path,
            "tokenizer_path": facts.model_path,
            "served_model_name": facts.served_model_name,
            "is_generation": True,
        }

    def vllm_config(self) -> dict[str, Any]:
        """The subset of vLLM's ``VllmConfig`` a router reads, in its JSON form."""
        facts = self.model.facts
        return {
            "model_config": {
                "model": facts.served_model_name,
                "served_model_name": facts.served_model_name,
                "tokenizer": facts.model_path,
                "max_model_len": facts.max_model_len,
            },
            "cache_config": {
                "block_size": facts.block_size,
                "enable_prefix_caching": True,
                "num_gpu_blocks": facts.num_blocks,
            },
            "scheduler_config": {
                "max_num_seqs": facts.max_num_seqs,
                "max_num_batched_tokens": facts.max_num_batched_tokens,
            },
            "kv_events_config": {
                "enable_kv_cache_events": facts.events_endpoint is not None,
                "publisher": "zmq" if facts.events_endpoint is not None else "null",
                "endpoint": facts.events_endpoint,
                "replay_endpoint": facts.replay_endpoint,
                "topic": facts.events_topic or "",
            },
        }

    def server_info_dict(self, config_format: str = "text") -> dict[str, Any]:
        """The ``/server_info`` document.

        Raises:
            RequestError: ``config_format`` is neither ``text`` nor ``json``.
        """
        if config_format not in CONFIG_FORMATS:
            raise RequestError(
                f"config_format must be 'text' or 'json', got {config_format!r}", param="config_format"
            )
        facts = self.model.facts
        vllm_config = self.vllm_config()
        return {
            **facts.info_dict(),
            "model_path": facts.model_path,
            "tokenizer_path": facts.model_path,
            "served_model_name": facts.served_model_name,
            "page_size": facts.block_size,
            "context_length": facts.max_model_len,
            "max_running_requests": facts.max_num_seqs,
            "chunked_prefill_size": facts.max_num_batched_tokens,
            "max_total_num_tokens": facts.kv_capacity_tokens,
            "vllm_config": vllm_config if config_format == "json" else _config_text(vllm_config),
        }

    def kv_event_sources_dict(self) -> dict[str, Any]:
        """The ``/kv_event_sources`` document: rank ``"0"`` when the engine publishes events."""
        facts = self.model.facts
        if facts.events_endpoint is None:
            return {}
        return {
            "0": {
                "endpoint": facts.events_endpoint,
                "replay_endpoint": facts.replay_endpoint,
                "topic": facts.events_topic or "",
                "publisher": "zmq",
                "encoding": "msgpack",
                "schema_version": 1,
                "enable_kv_cache_events": True,
                "hwm": EVENT_HWM,
            }
        }

    # ---------------------------------------------------------------- handlers

    async def model_info(self, request: web.Request) -> web.StreamResponse:
        return _ok(self.model_info_dict())

    async def server_info(self, request: web.Request) -> web.StreamResponse:
        return _ok(self.server_info_dict(request.query.get("config_format", "text")))

    async def get_server_info(self, request: web.Request) -> web.StreamResponse:
        body = self.server_info_dict(request.query.get("config_format", "text"))
        body["model_id"] = self.model.facts.served_model_name
        body["instance_id"] = self.instance_id
        return _ok(body)

    async def kv_event_sources(self, request: web.Request) -> web.StreamResponse:
        return _ok(self.kv_event_sources_dict())

    async def render_completion(self, request: web.Request) -> web.StreamResponse:
        # vllm-router renders every request on every worker: tokenizing off the event loop keeps
        # this engine's scheduler stepping meanwhile.
        body, ids_list = await completion_input(self.model, await request.read(), off_loop=True)
        limits = request_limits(self.model.facts, chat=False)
        base = f"cmpl-{uuid.uuid4().hex}"
        rendered = []
        for i, ids in enumerate(ids_list):
            request_id = base if len(ids_list) == 1 else f"{base}-{i}"
            rendered.append(self._generate_request(request_id, ids, body, limits))
        return _ok(rendered)

    async def render_chat(self, request: web.Request) -> web.StreamResponse:
        body, ids = await chat_input(self.model, await request.read(), off_loop=True)
        limits = request_limits(self.model.facts, chat=True)
        return _ok(self._generate_request(f"chatcmpl-{uuid.uuid4().hex}", ids, body, limits))

    # ---------------------------------------------------------------- rendering

    def _generate_request(
        self,
        request_id: str,
        ids: list[int],
        body: CompletionRequest | ChatCompletionRequest,
        limits: Limits,
    ) -> dict[str, Any]:
        """vLLM's ``GenerateRequest`` for one prompt, after generation's own validation."""
        params = sampling_params(body, len(ids), limits)
        return {
            "request_id": request_id,
            "token_ids": ids,
            "features": None,
            "sampling_params": {
                "n": 1,
                "max_tokens": params.max_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "seed": params.seed,
                "stop": stop_strings(body),
                "stop_token_ids": list(params.stop_token_ids),
                "ignore_eos": params.ignore_eos,
            },
            "model": body.model,
            "stream": body.stream,
            "stream_options": msgspec.to_builtins(body.stream_options) if body.stream else None,
            "cache_salt": body.cache_salt,
        }


def _config_text(config: dict[str, Any]) -> str:
    """A one-line ``section.key=value`` rendering, the role of vLLM's ``str(VllmConfig)``."""
    return ", ".join(
        f"{section}.{key}={value}" for section, fields in config.items() for key, value in fields.items()
    )
