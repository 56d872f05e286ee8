"""The engine's small routes: model list, health, tokenizer, metrics, ``/kvmesh/info``, cache reset."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from kvmesh.engine.metrics import CONTENT_TYPE
from kvmesh.engine.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    check_prompt_ids,
    decode_body,
    flatten_messages,
)
from kvmesh.errors import RequestError

if TYPE_CHECKING:
    from kvmesh.engine.server import EngineServer

_json = msgspec.json.Encoder()


def _ok(body: Any) -> web.Response:
    return web.Response(body=_json.encode(body), content_type="application/json")


class InfoApi:
    """Routes of one :class:`EngineServer` that describe it or answer without running the model."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server

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
        name = self.server.config.served_model_name
        return _ok(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "kvmesh", "root": name,
                     "parent": None, "max_model_len": self.server.max_model_len}
                ],
            }
        )  # fmt: skip

    async def health(self, request: web.Request) -> web.StreamResponse:
        return _ok({"status": "ok"})

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        body: TokenizeRequest = decode_body(await request.read(), TokenizeRequest)
        self.server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.prompt is not None:
            tokens = self.server.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            tokens = self.server.tokenizer.apply_chat_template(flatten_messages(body.messages or []))
        return _ok({"count": len(tokens), "max_model_len": self.server.max_model_len, "tokens": tokens})

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        body: DetokenizeRequest = decode_body(await request.read(), DetokenizeRequest)
        self.server.check_model(body.model)
        check_prompt_ids(body.tokens, self.server.vocab_size)
        return _ok({"prompt": self.server.tokenizer.decode(body.tokens)})

    async def metrics_handler(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.server.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def info_dict(self) -> dict[str, Any]:
        """The ``/kvmesh/info`` document."""
        core, info = self.server.core, self.server.core.runner.info
        return {
            "model": self.server.config.served_model_name,
            "revision": self.server.config.revision,
            "block_size": core.cache.block_size,
            "hash_algo": self.server.config.hash_algo,
            "events_endpoint": self.server.config.events_endpoint,
            "replay_endpoint": self.server.config.replay_endpoint,
            "events_topic": self.server.config.events_topic,
            "role": self.server.config.role.value,
            "kv_bytes_per_token": info.kv.bytes_per_token,
            "max_model_len": info.max_model_len,
            "kv_capacity_tokens": core.cache.capacity_blocks * core.cache.block_size,
            "max_num_seqs": core.config.max_num_seqs,
            "max_num_batched_tokens": core.config.max_num_batched_tokens,
            "emulate": self.server.config.emulate,
            "device": info.device,
            "store": core.has_store,
            **self.server.config.extra_info,
        }

    async def info(self, request: web.Request) -> web.StreamResponse:
        return _ok(self.info_dict())

    async def reset_prefix_cache(self, request: web.Request) -> web.StreamResponse:
        """Drop the device-tier cache (publishes AllBlocksCleared) and the store tiers only this
        engine reads (RAM, local disk), so it starts cold; a shared tier is the fleet's to empty.
        409 while requests hold blocks."""
        core = self.server.core
        if not core.cache.reset():
            raise RequestError("the prefix cache is in use by running requests", status=409)
        core.publish_events()
        # Writes still being copied or encoded would land after the reset: let them reach the store.
        await core.store_sync.wait(drain=False)
        removed = await core.store.reset_local()
        return _ok({"reset": True, "store_chunks_removed": removed})

    async def version(self, request: web.Request) -> web.StreamResponse:
        from kvmesh import __version__

        return _ok({"version": __version__})
