"""OpenAI request bodies into routing requests: validation, tokenization, tenant.

::

    raw body ─► JSON object ─► field checks ─► tenant (kvmesh.core.tenancy)
             ─► prompt ids (given ids checked, text through the tokenizer, chat through the
                chat template) ─► one u32 array ─► RoutingRequest(namespace = model + tenant)

The prompt ids are validated and converted to the index's u32 array here, once; that array is the
``RoutingRequest.tokens`` the scheduler hashes and matches, unchanged.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvmesh.core.agent_apis import PromptApi, chat_input
from kvmesh.core.hashing import Namespace, as_token_array
from kvmesh.core.json_body import NOT_JSON_ERRORS, not_json_error
from kvmesh.core.pins import check_pin_ttl, requested_pin_ttl, with_pin_ttl
from kvmesh.core.tenancy import CACHE_SALT_FIELD, SESSION_HEADER, resolve_tenant
from kvmesh.errors import RequestError
from kvmesh.router.first_miss import DEFAULT_MIN_CHARS, LongPrompt, long_prompt
from kvmesh.router.known_prefix import PromptIds
from kvmesh.router.tokenize import CachedTokenizer, PromptTokenizer
from kvmesh.router.types import RoutingRequest

DEFAULT_MAX_PIN_TTL_S = 86400.0
"""The longest pin a request may ask for unless the router's config says otherwise (one day)."""

_Tokens = np.ndarray | Callable[[int | None], PromptIds | None]
"""Prompt ids already converted, or a call that tokenizes the prompt's text: given a number of
characters, it returns ``None`` instead of tokenizing more than that (``None``: no limit)."""


@dataclass(slots=True)
class ParsedRequest:
    """One validated OpenAI request, ready to route.

    Attributes:
        body: the decoded body, with ``cache_salt`` set to the tenant when the header named it.
        raw: the body to forward: the client's bytes, re-encoded only when ``cache_salt`` was added.
        tenant: the tenant (``""``: none named).
        routing: what the scheduler sees; its ``tokens`` are the u32 prompt ids.
        pin_ttl_s: the pin the request asks for, in seconds (``None``: none); the forwarded body
            carries it as ``kvmesh.cache_ttl_s`` and ``kv_transfer_params.kvmesh_cache_ttl_s``.
        long_prompt: a long prompt left untokenized (``routing.tokens`` empty), for
            :func:`kvmesh.router.first_miss.tokenize_until_miss` once the namespace is final.
    """

    body: dict[str, Any]
    raw: bytes
    tenant: str
    routing: RoutingRequest
    pin_ttl_s: float | None = None
    long_prompt: LongPrompt | None = None


class RequestParser:
    """Validates and tokenizes completions and chat bodies.

    Args:
        tokenizer: text and chat tokenizer (``None``: text prompts are routed by load only).
        tokenize_thread_min_chars: a prompt with at least this many characters left to tokenize
            (after what the tokenizer's caches and learnt prefixes provide) is tokenized on a
            worker thread; the rest inline, without the thread's hand-offs.
        max_pin_ttl_s: the longest pin a request may ask for.
        first_miss_min_chars: text at least this long may be left to
            :func:`~kvmesh.router.first_miss.tokenize_until_miss` (``parse(until_first_miss=True)``).
    """

    def __init__(
        self,
        tokenizer: PromptTokenizer | None,
        *,
        tokenize_thread_min_chars: int,
        max_pin_ttl_s: float = DEFAULT_MAX_PIN_TTL_S,
        first_miss_min_chars: int = DEFAULT_MIN_CHARS,
    ) -> None:
        self.tokenizer = tokenizer
        self.tokenize_thread_min_chars = tokenize_thread_min_chars
        self.first_miss_min_chars = first_miss_min_chars
        self.max_pin_ttl_s = max_pin_ttl_s
        self._ids = itertools.count()

    async def parse(
        self,
        raw: bytes,
        headers: Mapping[str, str],
        *,
        chat: bool,
        model: str | None,
        revision: str | None,
        api: PromptApi | None = None,
        until_first_miss: bool = False,
    ) -> ParsedRequest:
        """Turn one request into a :class:`ParsedRequest`.

        Args:
            raw: the request body.
            headers: the request headers (case-insensitive).
            chat: a ``/v1/chat/completions`` body (else ``/v1/completions``).
            api: the body's format where it is ``/v1/responses`` or ``/v1/messages`` (rendered
                with the chat template, tools included, as the engine renders it); overrides ``chat``.
            model: the namespace model (``None``: the body's ``model``).
            revision: the namespace model revision.
            until_first_miss: leave a long text prompt untokenized in ``long_prompt`` (not when the
                request asks for a pin: pinning needs every block's key).

        Raises:
            RequestError: the body or the tenant is invalid.
        """
        if api is None:
            api = PromptApi.CHAT if chat else PromptApi.COMPLETIONS
        body, pending = self._validate(raw, api)
        tenant = resolve_tenant(headers, body.get(CACHE_SALT_FIELD))
        pin_ttl_s = requested_pin_ttl(headers, body)
        if pin_ttl_s is not None:
            check_pin_ttl(pin_ttl_s, self.max_pin_ttl_s)
        long = None
        if (
            until_first_miss
            and pin_ttl_s is None
            and not isinstance(pending, np.ndarray)
            and _is_long(body, self.first_miss_min_chars)
        ):
            # Inline: a chat's rendering is Python code, which holds the GIL on any thread.
            long = long_prompt(self.tokenizer, api, body, min_chars=self.first_miss_min_chars)
        known = None
        if long is not None:
            tokens = _NO_TOKENS
        elif isinstance(pending, np.ndarray):
            tokens = pending
        else:
            ids = pending(self.tokenize_thread_min_chars - 1)
            if ids is None:
                # The tokenizer releases the GIL: long texts use another core meanwhile.
                ids = await asyncio.to_thread(pending, None)
                assert ids is not None, "a prompt's ids without a limit are never None"
            tokens, known = ids.array, ids.known
        rewrite = False
        if tenant and body.get(CACHE_SALT_FIELD) != tenant:
            body[CACHE_SALT_FIELD] = tenant
            rewrite = True
        if pin_ttl_s is not None:
            # Engines read the body, and vLLM hands its KV connector only kv_transfer_params.
            with_pin_ttl(body, pin_ttl_s)
            rewrite = True
        if rewrite:
            raw = msgspec.json.encode(body)
        routing = RoutingRequest(
            request_id=f"r{next(self._ids)}",
            tokens=tokens,
            namespace=Namespace(model or str(body.get("model") or ""), revision or "", "", tenant),
            session_id=headers.get(SESSION_HEADER),
            known_prefix=known,
        )
        return ParsedRequest(body, raw, tenant, routing, pin_ttl_s, long)

    def _validate(self, raw: bytes, api: PromptApi) -> tuple[dict[str, Any], _Tokens]:
        """Validate a body; returns it with its token ids, or a call that tokenizes its text."""
        if not raw:
            raise RequestError("request body is empty; expected a JSON object")
        try:
            body = msgspec.json.decode(raw)
        except NOT_JSON_ERRORS as exc:
            raise not_json_error("request body is not valid JSON", exc) from exc
        if not isinstance(body, dict):
            raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError("'model' must be a string", param="model")
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise RequestError("'stream' must be a boolean", param="stream")
        salt = body.get(CACHE_SALT_FIELD)
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise RequestError("'cache_salt' must be a non-empty string", param=CACHE_SALT_FIELD)
        if api is PromptApi.RESPONSES or api is PromptApi.MESSAGES:
            return body, self._agent_tokens(api, body)
        if api is PromptApi.CHAT:
            return body, self._chat_tokens(body)
        return body, self._prompt_tokens(body.get("prompt", None), "prompt" in body)

    def _prompt_tokens(self, prompt: Any, present: bool) -> _Tokens:
        if not present:
            raise RequestError("'prompt' is required", param="prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str | list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("'prompt' must not be empty", param="prompt")
            tokenizer = self.tokenizer
            if tokenizer is None:
                return _NO_TOKENS
            if isinstance(tokenizer, CachedTokenizer):
                return lambda max_chars: tokenizer.encode_ids(prompt, max_chars=max_chars)
            return lambda max_chars: (
                None
                if max_chars is not None and len(prompt) > max_chars
                else PromptIds(as_token_array(tokenizer.encode(prompt)))
            )
        if isinstance(prompt, list):
            if not prompt:
                raise RequestError("'prompt' must not be empty", param="prompt")
            tokens = _token_array(prompt)
            if tokens is not None:
                return tokens
            raise RequestError(
                "'prompt' must be a string, a list of token ids in [0, 2^32), or a one-element list of either",
                param="prompt",
            )
        raise RequestError(
            f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}", param="prompt"
        )

    def _chat_tokens(self, body: dict[str, Any]) -> _Tokens:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
            content = message.get("content")
            if content is not None and not isinstance(content, str | list):
                raise RequestError(
                    f"messages[{i}].content must be a string or a list of parts", param="messages"
                )
        return self._chat_ids(body, messages, None)

    def _agent_tokens(self, api: PromptApi, body: dict[str, Any]) -> _Tokens:
        converted = chat_input(api, body)
        return self._chat_ids(body, converted.messages, converted.tools)

    def _chat_ids(self, body: dict[str, Any], messages: Any, tools: Any) -> _Tokens:
        tokenizer = self.tokenizer
        if tokenizer is None:
            return _NO_TOKENS
        if isinstance(tokenizer, CachedTokenizer):
            return lambda max_chars: tokenizer.chat_ids(messages, tools=tools, max_chars=max_chars)
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        return lambda max_chars: (
            None
            if max_chars is not None and _is_long(body, max_chars + 1)
            else PromptIds(as_token_array(tokenizer.apply_chat_template(messages, **extra)))
        )


_NO_TOKENS = as_token_array([])
"""The prompt ids of a text request without a tokenizer: it is routed by load only."""


def _token_array(value: list[Any]) -> np.ndarray | None:
    """``value`` as u32 token ids when every element is an int (not a bool) in [0, 2^32), else ``None``."""
    try:
        return as_token_array(msgspec.convert(value, list[int]))
    except (msgspec.ValidationError, ValueError):
        return None


def _is_long(body: dict[str, Any], min_chars: int) -> bool:
    """Whether tokenizing ``body``'s text is worth a hop to a worker thread."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt) >= min_chars
    if isinstance(prompt, list):
        return any(isinstance(p, str) and len(p) >= min_chars for p in prompt)
    messages = body.get("messages")
    total = 0
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        total += len(content) if isinstance(content, str) else min_chars
    return total >= min_chars
