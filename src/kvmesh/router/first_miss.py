"""Long prompts tokenized only as far as some cache holds them.

A 100k-token prompt takes about 200 ms to tokenize here (~2 µs a token), far over a router's
budget. Routing needs the prompt's block keys only up to the first block that no endpoint and no
shared tier holds: every endpoint's match is a run of blocks from the prompt's start, so past that
block all matches are settled and only the prompt's length still matters. A long prompt is
therefore tokenized in pieces that double in size, matched against the index after each piece,
and left alone once the match falls short of the tokenized blocks::

    text ─► piece 1 (~2k tokens) ─► ids ─► match ─► longest run < full blocks so far? ─► stop
                                                        │ no
            piece 2 (twice as long, from the cut) ◄─────┘

Each piece ends at a cut where the tokenizer provably composes (:mod:`kvmesh.router.prefix_tokens`:
a plain space after a printable ASCII character, on a byte-level BPE tokenizer that
:meth:`~kvmesh.router.prefix_tokens.PrefixReuse.supports`), so the ids so far are exactly the
leading ids of a full encode and the keys and the match equal those of a full encode. The rest of
the prompt is counted, not tokenized: its characters times the tokens per character of the part
tokenized. The longest piece end inside the part some cache holds is remembered as a known
prefix (:meth:`~kvmesh.router.prefix_tokens.PrefixReuse.remember`), so the next prompt with the same
start begins there, and pieces that straddle the first miss shrink request by request. Requests
whose later steps need every id (a pin, a history-based scorer) keep the full
encode, and so do short prompts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmesh.core.agent_apis import PromptApi, chat_input
from kvmesh.core.hashing import as_token_array
from kvmesh.errors import TierUnavailableError
from kvmesh.router.plugins.scorers import ApproximatePrefixScorer
from kvmesh.router.prefix_tokens import valid_cut
from kvmesh.router.scheduler import Scheduler
from kvmesh.router.tokenize import CachedTokenizer
from kvmesh.router.types import PrefixMatch, RoutingRequest

DEFAULT_MIN_CHARS = 65_536
"""Prompts shorter than this (about 16k tokens) are tokenized in full, as before."""

DEFAULT_FIRST_PIECE_CHARS = 8192
"""The first piece's length (about 2k tokens); each later piece is twice the previous one."""

_THREAD_MIN_CHARS = 4096
"""Shorter pieces (the rest after a known prefix, often) are tokenized without a thread hop."""

_MAX_CUT_TRIES = 256
"""Spaces tried backwards for a valid cut before the rest is tokenized in one piece."""

_NO_IDS = as_token_array([])


@dataclass(slots=True)
class LongPrompt:
    """A prompt's text still to be tokenized, and how.

    Attributes:
        text: the text the engine will tokenize (a chat already rendered with its template).
        add_special_tokens: whether the tokenizer adds its special tokens in front.
        tokenizer: a tokenizer that composes (:attr:`CachedTokenizer.composes`).
    """

    text: str
    add_special_tokens: bool
    tokenizer: CachedTokenizer


def whole_prompt_needed(scheduler: Scheduler) -> bool:
    """Whether some scorer predicts from its own history of whole prompts: a history-only
    prefix scorer. With ``beyond_cache`` (the default ``precise`` preset) the history serves
    prompts the caches have lost, and keeps what is tokenized of them: their leading pieces,
    where shared starts are."""
    return any(
        isinstance(ws.scorer, ApproximatePrefixScorer) and not ws.scorer.beyond_cache
        for profile in scheduler.profiles.values()
        for ws in profile.scorers
    )


def long_prompt(
    tokenizer: Any, api: PromptApi, body: dict[str, Any], *, min_chars: int = DEFAULT_MIN_CHARS
) -> LongPrompt | None:
    """The text of a validated ``body`` when it is long enough to tokenize until its first miss.

    Returns:
        ``None`` for short prompts, prompts given as ids, and tokenizers that do not compose.
    """
    if not isinstance(tokenizer, CachedTokenizer) or not tokenizer.composes:
        return None
    if api is PromptApi.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str) and len(prompt) >= min_chars:
            return LongPrompt(prompt, True, tokenizer)
        return None
    if api is PromptApi.CHAT:
        messages, tools = body.get("messages"), None
    else:
        converted = chat_input(api, body)
        messages, tools = converted.messages, converted.tools
    if _content_chars(messages) < min_chars:
        return None
    text = tokenizer.render_chat(messages, tools=tools)
    return None if text is None else LongPrompt(text, False, tokenizer)


def _content_chars(messages: Any) -> int:
    total = 0
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return total


def next_cut(text: str, start: int, target: int) -> int:
    """The last valid cut in ``text`` after ``start`` and at or before ``target``; ``len(text)``
    when ``target`` reaches the end or no valid cut is found near it."""
    if target >= len(text):
        return len(text)
    cut = text.rfind(" ", start + 1, target + 1)
    for _ in range(_MAX_CUT_TRIES):
        if cut <= start:
            break
        if valid_cut(text, cut):
            return cut
        cut = text.rfind(" ", start + 1, cut)
    return len(text)


async def tokenize_until_miss(
    prompt: LongPrompt,
    routing: RoutingRequest,
    scheduler: Scheduler,
    *,
    off_loop: bool,
    first_piece_chars: int = DEFAULT_FIRST_PIECE_CHARS,
) -> PrefixMatch:
    """Tokenize ``prompt`` piece by piece until the index's match falls short of it.

    Sets ``routing.tokens`` to the ids tokenized (the leading ids of a full encode, the first
    block no cache holds included), ``routing.num_prompt_tokens`` to the estimated length of
    the whole prompt (``None`` when it was tokenized to its end) and ``routing.known_prefix`` to
    the learnt prefix the ids start with.

    Args:
        prompt: the prompt's text.
        routing: the request (its namespace final: the LoRA adapter already resolved).
        scheduler: matches the ids against its index.
        off_loop: match on a worker thread (an index that does network I/O).
        first_piece_chars: characters in the first piece.

    Returns:
        The prefix match: equal to the match of the whole prompt's ids, with ``num_blocks``
        from the estimated length; a match of nothing when a remote index cannot be reached.
    """
    if first_piece_chars <= 0:
        raise ValueError(f"first_piece_chars must be > 0, got {first_piece_chars}")
    text = prompt.text
    reuse = prompt.tokenizer.prefixes
    known = None if reuse is None else reuse.longest_known(text, prompt.add_special_tokens)
    if reuse is not None and len(text) - (0 if known is None else len(known.text)) > first_piece_chars:
        # A start shared with recent prompts (a system prompt no cache holds yet) is tokenized
        # once, here, and reused by every later prompt with it.
        known = (
            await asyncio.to_thread(
                reuse.learn_shared, text, prompt.add_special_tokens, 0 if known is None else len(known.text)
            )
            or known
        )
    # The known prefix's ids are packed once, when it was learnt: only the pieces are converted.
    start, ids = (0, _NO_IDS) if known is None else (len(known.text), known.array)
    routing.known_prefix = known
    cuts: list[tuple[int, int]] = []  # (characters, ids) at each piece's end
    size = first_piece_chars
    while True:
        cut = next_cut(text, start, start + size)
        special = prompt.add_special_tokens and start == 0
        piece = text[start:cut]
        piece_ids = as_token_array(
            prompt.tokenizer.encode_piece(piece, special)
            if len(piece) < _THREAD_MIN_CHARS
            else await asyncio.to_thread(prompt.tokenizer.encode_piece, piece, special)
        )
        ids = np.concatenate((ids, piece_ids)) if len(ids) else piece_ids
        start, size = cut, size * 2
        cuts.append((start, len(ids)))
        routing.tokens = ids
        routing.num_prompt_tokens = (
            None if start >= len(text) else len(ids) + round((len(text) - start) * len(ids) / start)
        )
        try:
            # Unaligned: rounding to an engine's larger blocks could hide a run that goes on.
            found = (
                await asyncio.to_thread(scheduler.match, routing, aligned=False)
                if off_loop
                else scheduler.match(routing, aligned=False)
            )
        except TierUnavailableError:
            return PrefixMatch(
                scheduler.hasher(routing.namespace).num_full_blocks(routing.num_tokens), scheduler.block_size
            )
        # Every run from block 0 ends before the last full block tokenized: more ids change none.
        held = found.longest_blocks() * found.block_size
        if start >= len(text) or held + found.block_size <= len(ids):
            if reuse is not None:
                # The longest cut inside what some cache holds: later prompts with it start there.
                shared = [c for c in cuts if c[1] <= held]
                if shared:
                    reuse.remember(text[: shared[-1][0]], ids[: shared[-1][1]], prompt.add_special_tokens)
            return found if scheduler.align_match is None else scheduler.align_match(found)
