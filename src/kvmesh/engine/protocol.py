"""OpenAI request bodies the engine accepts, and their validation into engine terms.

Unknown fields are ignored (clients send many); fields the engine reads are type-checked by msgspec
and range-checked here. Every rejection is a :class:`~kvmesh.errors.RequestError` whose message says
which field is wrong and why; the server turns it into OpenAI's error shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvmesh.core.agent_apis import joined_text
from kvmesh.core.json_body import NOT_JSON_ERRORS, not_json_error
from kvmesh.core.tenancy import Role
from kvmesh.core.tokens import Tokenizer
from kvmesh.engine.runner import SamplingParams
from kvmesh.errors import RequestError


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    kvmesh: dict[str, Any] | None = None
    """kvmesh's own options: ``{"cache_ttl_s": N}`` pins the prompt (:mod:`kvmesh.core.pins`)."""


class CompletionRequest(_Common, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either."""

    prompt: Any


class ChatCompletionRequest(_Common, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize``: either ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def decode_body(body: bytes, cls: type[Any]) -> Any:
    """Parse a JSON body into ``cls``.

    Raises:
        RequestError: not JSON (or not UTF-8, or nested deeper than the decoder allows), not an
            object, missing or mistyped fields.
    """
    if not body.strip():
        raise RequestError("request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = None
        if "`$." in message:
            param = message.rsplit("`$.", 1)[1].rstrip("`").split("[")[0].split(".")[0]
        elif "missing required field" in message:
            param = message.rsplit("`", 2)[-2]
        raise RequestError(f"invalid request: {message}", param=param) from exc
    except NOT_JSON_ERRORS as exc:
        raise not_json_error("invalid JSON body", exc) from exc


def prompt_list(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completion request: one text, one id list, or a batch of either.

    Raises:
        RequestError: anything else, or an empty prompt.
    """
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        items = prompt
    else:
        raise RequestError("prompt must be a string, a list of token ids, or a list of those", param="prompt")
    out: list[str | list[int]] = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            if not p:
                raise RequestError(f"prompt[{i}] is empty", param="prompt")
            out.append(p)
        elif isinstance(p, list) and p and all(_is_token_id(t) for t in p):
            out.append([int(t) for t in p])
        else:
            raise RequestError(f"prompt[{i}] must be a non-empty string or list of token ids", param="prompt")
    return out


def prompt_ids(prompts: list[str | list[int]], tokenizer: Tokenizer, vocab_size: int) -> list[list[int]]:
    """Each prompt's token ids: texts encoded, id lists checked against ``vocab_size``.

    Raises:
        RequestError: an id outside the vocabulary.
    """
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            out.append(tokenizer.encode(prompt))
        else:
            check_prompt_ids(prompt, vocab_size, i)
            out.append(prompt)
    return out


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def flatten_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn OpenAI content-part lists into plain strings so any chat template renders them.

    Raises:
        RequestError: a message has no role, or content that is neither text nor text parts.
    """
    if not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"messages[{i}].role must be a non-empty string", param="messages")
        content = message.get("content", "")
        if content is None:
            content = ""
        content = joined_text(
            content,
            f"messages[{i}].content",
            "messages",
            types=("text",),
            items="parts",
            item_shape="{'type': 'text', 'text': ...}",
        )
        out.append({**message, "role": role, "content": content})
    return out


@dataclass(slots=True)
class Limits:
    max_model_len: int
    vocab_size: int
    default_max_tokens: int | None
    """``None``: fill the context (chat); else the default (completions: 16)."""


def check_prompt_ids(ids: list[int], vocab_size: int, index: int = 0) -> None:
    bad = next((t for t in ids if t < 0 or t >= vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"prompt[{index}] has token id {bad} outside the vocabulary [0, {vocab_size})", param="prompt"
        )


def sampling_params(req: _Common, num_prompt_tokens: int, limits: Limits) -> SamplingParams:
    """Validate sampling fields against the prompt length and build the engine's parameters.

    Raises:
        RequestError: a value is out of range or the prompt does not leave room for one token.
    """
    if num_prompt_tokens >= limits.max_model_len:
        raise RequestError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your prompt "
            f"has {num_prompt_tokens} tokens, which leaves no room for output.",
            param="prompt",
        )
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    room = limits.max_model_len - num_prompt_tokens
    if max_tokens is None:
        max_tokens = room if limits.default_max_tokens is None else min(limits.default_max_tokens, room)
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens > room:
        raise RequestError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for "
            "the completion). Please reduce the length of the prompt or max_tokens.",
            param="max_tokens",
        )
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise RequestError(f"temperature must be in [0, 2], got {temperature}", param="temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    if req.n != 1:
        raise RequestError(f"only n=1 is supported, got n={req.n}", param="n")
    stop_ids = tuple(req.stop_token_ids or ())
    if any(t < 0 or t >= limits.vocab_size for t in stop_ids):
        raise RequestError("stop_token_ids must lie in the vocabulary", param="stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        stop_token_ids=stop_ids,
    )


def stop_strings(req: _Common) -> list[str]:
    if req.stop is None:
        return []
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if len(stops) > 16:
        raise RequestError(f"at most 16 stop strings, got {len(stops)}", param="stop")
    return [s for s in stops if s]


def request_role(req: _Common, default: Role) -> Role:
    """The P/D role from ``kv_transfer_params.role`` (else the engine's own role).

    Raises:
        RequestError: an unknown role.
    """
    params = req.kv_transfer_params
    if not params or params.get("role") is None:
        return default
    role = params.get("role")
    try:
        return Role(str(role))
    except ValueError:
        raise RequestError(
            f"kv_transfer_params.role must be 'prefill', 'decode' or 'both', got {role!r}",
            param="kv_transfer_params",
        ) from None
