"""``POST /v1/responses`` (OpenAI) and ``POST /v1/messages`` (Anthropic) on the engine.

Each body becomes chat-template input with :func:`kvmesh.core.agent_apis.chat_input` (the call the
router makes too, so both sides render and tokenize the same ids, tools included), runs as a chat
completion, and is answered in its own API's shape: a response or message object, or, streamed,
that API's server-sent events. Only text output is produced (no tool-call parsing).
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from kvmesh.core.agent_apis import PromptApi, chat_input
from kvmesh.engine.protocol import ChatCompletionRequest, decode_body
from kvmesh.errors import RequestError

if TYPE_CHECKING:
    from kvmesh.engine.server import EngineServer

_json = msgspec.json.Encoder()

_SAMPLING_FIELDS = ("model", "temperature", "top_p", "stream", "cache_salt", "kvmesh", "kv_transfer_params")


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _json.encode(data) + b"\n\n"


class AgentFrames(ABC):
    """How one request's chat output is written in an agent API's shape.

    Args:
        model: the served model name.
        prefix: the id prefix of the API's objects.
    """

    def __init__(self, model: str, prefix: str) -> None:
        self.model = model
        self.id = f"{prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text: list[str] = []

    def complete(self, result: dict[str, Any]) -> dict[str, Any]:
        """The non-streamed answer built from a ``chat.completion`` result."""
        choice = result["choices"][0]
        self.text = [choice["message"]["content"]]
        return self._final(choice["finish_reason"], result["usage"])

    @abstractmethod
    def opening(self, usage: dict[str, Any]) -> bytes:
        """Events before the first text (``usage``: the chat usage known at admission)."""

    @abstractmethod
    def delta(self, text: str) -> bytes:
        """The events of one piece of text."""

    @abstractmethod
    def closing(self, finish_reason: str | None, usage: dict[str, Any]) -> bytes:
        """The events that end the stream."""

    @abstractmethod
    def _final(self, finish_reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        """The whole answer object once generation ended."""


class ResponsesFrames(AgentFrames):
    """OpenAI Responses: a ``response`` object; streamed as ``response.*`` events."""

    def __init__(self, model: str) -> None:
        super().__init__(model, "resp_")
        self.item_id = f"msg_{uuid.uuid4().hex}"

    def _response(self, status: str, output: list[dict[str, Any]], usage: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "usage": usage}  # fmt: skip

    def _item(self, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": "".join(self.text), "annotations": []}]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": content if status == "completed" else []}  # fmt: skip

    def _final(self, finish_reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        status = "incomplete" if finish_reason == "length" else "completed"
        body = self._response(status, [self._item("completed")], _responses_usage(usage))
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body

    def opening(self, usage: dict[str, Any]) -> bytes:
        where = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        part = {"type": "output_text", "text": "", "annotations": []}
        return (
            _event(
                "response.created",
                {"type": "response.created", "response": self._response("in_progress", [], None)},
            )
            + _event(
                "response.output_item.added",
                {"type": "response.output_item.added", "output_index": 0, "item": self._item("in_progress")},
            )
            + _event(
                "response.content_part.added", {"type": "response.content_part.added", **where, "part": part}
            )
        )

    def delta(self, text: str) -> bytes:
        if not text:
            return b""
        self.text.append(text)
        return _event("response.output_text.delta", {"type": "response.output_text.delta", "output_index": 0,
                                                     "item_id": self.item_id, "content_index": 0, "delta": text})  # fmt: skip

    def closing(self, finish_reason: str | None, usage: dict[str, Any]) -> bytes:
        where = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        text = "".join(self.text)
        part = {"type": "output_text", "text": text, "annotations": []}
        final = self._final(finish_reason, usage)
        done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return (
            _event("response.output_text.done", {"type": "response.output_text.done", **where, "text": text})
            + _event(
                "response.content_part.done", {"type": "response.content_part.done", **where, "part": part}
            )
            + _event(
                "response.output_item.done",
                {"type": "response.output_item.done", "output_index": 0, "item": self._item("completed")},
            )
            + _event(done, {"type": done, "response": final})
        )


def _responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": usage["prompt_tokens_details"],
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


class MessagesFrames(AgentFrames):
    """Anthropic Messages: a ``message`` object; streamed as ``message_*`` / ``content_block_*`` events."""

    def __init__(self, model: str) -> None:
        super().__init__(model, "msg_")

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None, usage: Any) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": None, "usage": usage}  # fmt: skip

    def _final(self, finish_reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        content = [{"type": "text", "text": "".join(self.text)}]
        return self._message(
            content, _STOP_REASONS.get(finish_reason or "", "end_turn"), _anthropic_usage(usage)
        )

    def opening(self, usage: dict[str, Any]) -> bytes:
        start = {"type": "message_start", "message": self._message([], None, _anthropic_usage(usage))}
        block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        return _event("message_start", start) + _event("content_block_start", block)

    def delta(self, text: str) -> bytes:
        if not text:
            return b""
        self.text.append(text)
        data = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
        return _event("content_block_delta", data)

    def closing(self, finish_reason: str | None, usage: dict[str, Any]) -> bytes:
        stop = _STOP_REASONS.get(finish_reason or "", "end_turn")
        delta = {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                 "usage": _anthropic_usage(usage)}  # fmt: skip
        return (
            _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + _event("message_delta", delta)
            + _event("message_stop", {"type": "message_stop"})
        )


def _anthropic_usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = int(usage["prompt_tokens_details"].get("cached_tokens", 0))
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage["completion_tokens"],
    }


class AgentApi:
    """The engine's ``/v1/responses`` and ``/v1/messages`` routes.

    Args:
        server: the engine server whose chat path runs the requests.
    """

    def __init__(self, server: EngineServer) -> None:
        self.server = server

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post(PromptApi.RESPONSES.path, self.responses)
        router.add_post(PromptApi.MESSAGES.path, self.messages)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, PromptApi.RESPONSES)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, PromptApi.MESSAGES)

    async def _serve(self, request: web.Request, api: PromptApi) -> web.StreamResponse:
        server = self.server
        body: dict[str, Any] = decode_body(await request.read(), dict[str, Any])
        converted = chat_input(api, body)
        chat = _chat_request(api, body, converted.messages)
        server.check_model(chat.model)
        ids = server.tokenizer.apply_chat_template(converted.messages, tools=converted.tools or None)
        name = server.config.served_model_name
        frames = ResponsesFrames(name) if api is PromptApi.RESPONSES else MessagesFrames(name)
        return await server.generate_chat(request, chat, ids, frames)


def _chat_request(
    api: PromptApi, body: dict[str, Any], messages: list[dict[str, Any]]
) -> ChatCompletionRequest:
    fields = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    limit = body.get("max_output_tokens" if api is PromptApi.RESPONSES else "max_tokens")
    if limit is not None:
        fields["max_tokens"] = limit
    if api is PromptApi.MESSAGES and body.get("stop_sequences") is not None:
        fields["stop"] = body["stop_sequences"]
    try:
        return msgspec.convert({**fields, "messages": messages}, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid request: {exc}") from exc
