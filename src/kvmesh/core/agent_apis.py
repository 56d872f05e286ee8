"""OpenAI ``/v1/responses`` and Anthropic ``/v1/messages`` bodies as chat-template input.

The router and the engine both call :func:`chat_input` on the same body, then render the result
with the model's chat template (tools included) and encode it without extra specials, so the
router hashes exactly the ids the engine caches. Only the stateless subset is taken: a body that
points at server-side state (``previous_response_id``, ``conversation``) or holds non-text
content is a :class:`~kvmesh.errors.RequestError` naming the field, never a silent guess.

::

    responses: instructions ─► system   input items ─► user/assistant/system messages
               function_call ─► assistant tool_calls   function_call_output ─► tool message
    messages:  system ─► system   text blocks ─► content   tool_use ─► assistant tool_calls
               tool_result ─► tool message   tools[].input_schema ─► function parameters
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgspec

from kvmesh.errors import RequestError


class PromptApi(enum.StrEnum):
    """The request formats whose prompts the router tokenizes."""

    COMPLETIONS = "completions"
    CHAT = "chat"
    RESPONSES = "responses"
    MESSAGES = "messages"

    @property
    def path(self) -> str:
        """The route that serves this API."""
        return _PATHS[self]

    @property
    def is_chat(self) -> bool:
        """Whether the prompt is rendered with the chat template."""
        return self is not PromptApi.COMPLETIONS


_PATHS = {
    PromptApi.COMPLETIONS: "/v1/completions",
    PromptApi.CHAT: "/v1/chat/completions",
    PromptApi.RESPONSES: "/v1/responses",
    PromptApi.MESSAGES: "/v1/messages",
}


@dataclass(frozen=True, slots=True)
class ChatInput:
    """What the chat template renders: plain-text messages and OpenAI function tools.

    Attributes:
        messages: ``{"role", "content": str}`` messages, with ``tool_calls`` / ``tool_call_id``
            where the conversation has tool use.
        tools: ``{"type": "function", "function": {...}}`` entries (empty: none).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


def chat_input(api: PromptApi, body: dict[str, Any]) -> ChatInput:
    """The chat-template input of a ``/v1/responses`` or ``/v1/messages`` body.

    Raises:
        RequestError: a field of the wrong shape, or one that needs server-side state.
    """
    if api is PromptApi.RESPONSES:
        return ChatInput(_responses_messages(body), _responses_tools(body.get("tools")))
    if api is PromptApi.MESSAGES:
        return ChatInput(_anthropic_messages(body), _anthropic_tools(body.get("tools")))
    raise ValueError(f"chat_input takes responses or messages bodies, got {api}")


def _json_text(value: Any) -> str:
    return msgspec.json.encode(value).decode()


# ---------------------------------------------------------------- OpenAI Responses


def _responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    for field in ("previous_response_id", "conversation"):
        if body.get(field) is not None:
            raise RequestError(
                f"'{field}' needs server-side conversation state, which is not kept; "
                "send the whole conversation in 'input'",
                param=field,
            )
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        if not items:
            raise RequestError("'input' must not be empty", param="input")
        messages.append({"role": "user", "content": items})
        return messages
    if not isinstance(items, list) or not items:
        raise RequestError("'input' must be a non-empty string or list of items", param="input")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RequestError(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(
                    f"input[{i}].role must be user, assistant, system or developer, got {role!r}",
                    param="input",
                )
            text = _responses_text(item.get("content"), f"input[{i}].content")
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments")
            if not (isinstance(name, str) and isinstance(call_id, str) and isinstance(arguments, str)):
                raise RequestError(
                    f"input[{i}] (function_call) needs string 'name', 'call_id' and 'arguments'",
                    param="input",
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            _append_tool_call(messages, call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise RequestError(
                    f"input[{i}] (function_call_output) needs string 'call_id' and 'output'", param="input"
                )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise RequestError(
                f"input[{i}].type {kind!r} is not supported; use message, function_call or "
                "function_call_output",
                param="input",
            )
    return messages


def _responses_text(content: Any, where: str) -> str:
    return joined_text(
        content,
        where,
        "input",
        types=("input_text", "output_text", "text"),
        items="parts",
        item_shape="{'type': 'input_text' or 'output_text', 'text': ...}",
    )


def joined_text(
    content: Any, where: str, param: str, *, types: tuple[str, ...], items: str, item_shape: str
) -> str:
    """``content`` as a string, or the text of its list of typed text ``items``, joined.

    Args:
        content: a message's content: a string, or a list of ``{"type": ..., "text": ...}`` items.
        where: the content's place in the body, for messages (``"messages[2].content"``).
        param: the request field named in errors.
        types: the item types taken as text.
        items: what the API calls the items (``"parts"``, ``"blocks"``).
        item_shape: the item shape the API documents, for messages.

    Raises:
        RequestError: neither a string nor a list of text items.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text {items}", param=param)
    texts = []
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") not in types
            or not isinstance(part.get("text"), str)
        ):
            raise RequestError(f"{where} {items} must be {item_shape}", param=param)
        texts.append(part["text"])
    return "".join(texts)


def _responses_tools(tools: Any) -> list[dict[str, Any]]:
    return _function_tools(
        tools,
        tool_type="function",
        schema_field="parameters",
        shape="a function tool with a string 'name' (built-in tools are not served)",
    )


def _function_tools(
    tools: Any, *, tool_type: str | None, schema_field: str, shape: str
) -> list[dict[str, Any]]:
    """The Chat Completions ``tools`` for an agent API's ``tools``: each a ``shape`` object whose
    ``type`` (when ``tool_type`` is set) is ``tool_type`` and whose JSON schema is ``schema_field``."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or (tool_type is not None and tool.get("type") != tool_type)
            or not isinstance(tool.get("name"), str)
        ):
            raise RequestError(f"tools[{i}] must be {shape}", param="tools")
        function: dict[str, Any] = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if isinstance(tool.get(schema_field), dict):
            function["parameters"] = tool[schema_field]
        out.append({"type": "function", "function": function})
    return out


def _append_tool_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """Consecutive calls belong to one assistant turn, after that turn's text if it has one."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


# ---------------------------------------------------------------- Anthropic Messages


def _anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _anthropic_text(system, "system", "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
            raise RequestError(
                f"messages[{i}] must be an object with role user or assistant", param="messages"
            )
        role, content = turn["role"], turn.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list) or not content:
            raise RequestError(
                f"messages[{i}].content must be a string or a non-empty list of blocks", param="messages"
            )
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                call_id, name = block.get("id"), block.get("name")
                if not isinstance(call_id, str) or not isinstance(name, str):
                    raise RequestError(f"{where} (tool_use) needs string 'id' and 'name'", param="messages")
                arguments = _json_text(block.get("input", {}))
                calls.append(
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                )
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str):
                    raise RequestError(
                        f"{where} (tool_result) needs a string 'tool_use_id'", param="messages"
                    )
                result = _anthropic_text(block.get("content", ""), where, "messages")
                messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
            else:
                raise RequestError(
                    f"{where} must be a text block, a tool_use block (assistant) or a tool_result "
                    f"block (user), got {kind!r}",
                    param="messages",
                )
        if texts:
            messages.append({"role": role, "content": "".join(texts)})
        for call in calls:
            _append_tool_call(messages, call)
    return messages


def _anthropic_text(content: Any, where: str, param: str) -> str:
    return joined_text(
        content, where, param, types=("text",), items="blocks", item_shape="{'type': 'text', 'text': ...}"
    )


def _anthropic_tools(tools: Any) -> list[dict[str, Any]]:
    return _function_tools(
        tools, tool_type=None, schema_field="input_schema", shape="an object with a string 'name'"
    )
