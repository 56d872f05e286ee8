"""The engine's small routes: model list, health, tokenizer, metrics, ``/kvmesh/info``, cache reset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from aiohttp import web

from kvmesh.engine.facts import ServedModel
from kvmesh.engine.metrics import CONTENT_TYPE, EngineMetrics
from kvmesh.engine.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    check_prompt_ids,
    decode_body,
    flatten_messages,
)
from kvmesh.errors import RequestError

_json = msgspec.json.Encoder()


def _ok(body: Any) -> web.Response:
    return web.Response(body=_json.encode(body), content_type="application/json")


class PrefixCacheReset(Protocol):
    """The one engine operation these routes run."""

    async def reset_prefix_cache(self) -> int | None:
        """See :meth:`kvmesh.engine.core.EngineCore.reset_prefix_cache`."""
        ...


@dataclass(slots=True, eq=False)
class InfoApi:
    """Routes that describe an engine or answer without running the model.

    Args:
        model: the served model's facts, tokenizer and name check.
        metrics: renders ``/metrics``.
        cache: resets the prefix cache.
    """

    model: ServedModel
    metrics: EngineMetrics
    cache: PrefixCacheReset

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/models", self.models)
        router.add_get("/health", self.health)
        router.add_post("/tokenize", self.tokenize)
        router.add_post("/detokenize", self.detokenize)
        router.add_get("/metrics", self.metrics_handler)
        router.add_get("/kvmesh/info", self.info)
        router.add_get("/version", self.version)
        router.add_post("/reset_prefix_cache", self.reset_prefix_cache)

    async def models(self, request: web.Request) -> web.StreamResponse:
        facts = self.model.facts
        name = facts.served_model_name
        return _ok(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "kvmesh", "root": name,
                     "parent": None, "max_model_len": facts.max_model_len}
                ],
            }
        )  # fmt: skip

    async def health(self, request: web.Request) -> web.StreamResponse:
        return _ok({"status": "ok"})

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        body: TokenizeRequest = decode_body(await request.read(), TokenizeRequest)
        self.model.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give exactly one of 'prompt' or 'messages'", param="prompt")
        tokenizer = self.model.tokenizer
        if body.prompt is not None:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            tokens = tokenizer.apply_chat_template(flatten_messages(body.messages or []))
        return _ok({"count": len(tokens), "max_model_len": self.model.facts.max_model_len, "tokens": tokens})

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        body: DetokenizeRequest = decode_body(await request.read(), DetokenizeRequest)
        self.model.check_model(body.model)
        check_prompt_ids(body.tokens, self.model.facts.prompt_vocab_size)
        return _ok({"prompt": self.model.tokenizer.decode(body.tokens)})

    async def metrics_handler(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def info(self, request: web.Request) -> web.StreamResponse:
        return _ok(self.model.facts.info_dict())

    async def reset_prefix_cache(self, request: web.Request) -> web.StreamResponse:
        """Drop the device-tier cache and the store tiers only this engine reads; 409 while requests
        hold blocks."""
        removed = await self.cache.reset_prefix_cache()
        if removed is None:
            raise RequestError("the prefix cache is in use by running requests", status=409)
        return _ok({"reset": True, "store_chunks_removed": removed})

    async def version(self, request: web.Request) -> web.StreamResponse:
        from kvmesh import __version__

        return _ok({"version": __version__})
