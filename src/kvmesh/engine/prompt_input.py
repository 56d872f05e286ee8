"""A completion or chat body read into the token ids it asks for, alike for serving and rendering.

``/v1/completions`` and ``/v1/chat/completions`` (:mod:`kvmesh.engine.server`) and their
``/render`` twins for peer routers (:mod:`kvmesh.engine.peer_api`) accept the same bodies: the
same checks, the same ids, the same limits on what may be asked of them.
"""

from __future__ import annotations

import asyncio

from kvmesh.engine.facts import EngineFacts, ServedModel
from kvmesh.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    decode_body,
    flatten_messages,
    prompt_ids,
    prompt_list,
)
from kvmesh.errors import RequestError

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) ``max_tokens`` of a completion that names none."""


async def completion_input(
    model: ServedModel, raw: bytes, *, off_loop: bool = False
) -> tuple[CompletionRequest, list[list[int]]]:
    """The body of a completion request and each of its prompts' ids.

    Args:
        model: the served model (its name, tokenizer and vocabulary).
        raw: the request body.
        off_loop: tokenize on a worker thread, so the event loop keeps serving meanwhile.

    Raises:
        RequestError: an invalid body, another model's name, several prompts streamed, or an id
            outside the vocabulary.
    """
    body: CompletionRequest = decode_body(raw, CompletionRequest)
    model.check_model(body.model)
    prompts = prompt_list(body.prompt)
    if body.stream and len(prompts) > 1:
        raise RequestError("stream=true takes a single prompt", param="prompt")
    vocab_size = model.facts.prompt_vocab_size
    if off_loop:
        return body, await asyncio.to_thread(prompt_ids, prompts, model.tokenizer, vocab_size)
    return body, prompt_ids(prompts, model.tokenizer, vocab_size)


async def chat_input(
    model: ServedModel, raw: bytes, *, off_loop: bool = False
) -> tuple[ChatCompletionRequest, list[int]]:
    """The body of a chat request and its conversation's ids through the chat template.

    Args:
        model: the served model (its name and tokenizer).
        raw: the request body.
        off_loop: apply the template on a worker thread, so the event loop keeps serving meanwhile.

    Raises:
        RequestError: an invalid body or messages, or another model's name.
    """
    body: ChatCompletionRequest = decode_body(raw, ChatCompletionRequest)
    model.check_model(body.model)
    messages = flatten_messages(body.messages)
    if off_loop:
        return body, await asyncio.to_thread(model.tokenizer.apply_chat_template, messages)
    return body, model.tokenizer.apply_chat_template(messages)


def request_limits(facts: EngineFacts, *, chat: bool) -> Limits:
    """What a request may ask of this engine: a chat fills the context by default, a completion
    generates :data:`COMPLETION_DEFAULT_MAX_TOKENS`."""
    return Limits(
        facts.max_model_len, facts.prompt_vocab_size, None if chat else COMPLETION_DEFAULT_MAX_TOKENS
    )
