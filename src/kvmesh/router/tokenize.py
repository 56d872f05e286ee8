"""Prompt tokenization for routing: the Rust tokenizer called directly, plus an exact-match cache.

The gateway must hash exactly the ids the engine will cache, so nothing here approximates:

- ``encode`` goes to the fast tokenizer's ``encode_batch_fast`` (ids only, no offsets), which
  returns the ids :meth:`kvmesh.core.tokens.Tokenizer.encode` returns, about 20% cheaper; a
  tokenizer without a fast backend is called as is.
- prompts that share a long leading part with earlier ones reuse that part's ids where the
  tokenizer provably composes (:mod:`kvmesh.router.prefix_tokens`);
- a bounded LRU maps *exact* inputs to their ids: the whole prompt string (with the
  special-tokens flag), or a chat's whole message list serialized to JSON (which also skips
  rendering the template). Tokenization is a pure function of these inputs, so a hit returns
  what a fresh call would; a prompt that differs by one character is a different key.

``encode_ids`` and ``chat_ids`` give the ids packed as one u32 array (what routing hashes) with
the learnt prefix they start with, and tokenize inline only up to a limit, so a caller can send
long work to a thread and do the rest (cache hits, a short question after a learnt system
prompt) without one. Callers get cached arrays themselves and must not mutate them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Protocol, runtime_checkable

import msgspec

from kvmesh.core.hashing import as_token_array
from kvmesh.router.known_prefix import PromptIds
from kvmesh.router.prefix_tokens import PrefixReuse

DEFAULT_CACHE_ENTRIES = 4096
DEFAULT_CACHE_MAX_CHARS = 32_768
"""Longer inputs are tokenized every time instead of being cached (bounds the cache's memory)."""


class PromptTokenizer(Protocol):
    """What the gateway needs from a tokenizer (:class:`kvmesh.core.tokens.Tokenizer` fits)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: Any, *, add_generation_prompt: bool = True) -> list[int]: ...


@runtime_checkable
class FastPromptTokenizer(PromptTokenizer, Protocol):
    """A tokenizer that also offers its fast backend and renders a chat to text
    (:class:`kvmesh.core.tokens.Tokenizer` does)."""

    @property
    def fast_backend(self) -> Any | None:
        """The ``tokenizers`` object behind it, where it has one."""
        ...

    def render_chat(self, messages: Any, *, add_generation_prompt: bool = True, tools: Any = None) -> str:
        """The chat template's text for ``messages`` (and function ``tools``)."""
        ...


class CachedTokenizer:
    """A :class:`PromptTokenizer` with a fast encode path and an exact-match LRU.

    Safe to call from several threads (the gateway tokenizes long prompts on worker threads).

    Args:
        tokenizer: the model's tokenizer.
        cache_entries: most cached inputs (0 disables the cache).
        cache_max_chars: inputs longer than this are not cached.
        prefix_reuse: reuse shared leading parts' ids where the tokenizer allows it.
    """

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        *,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        cache_max_chars: int = DEFAULT_CACHE_MAX_CHARS,
        prefix_reuse: bool = True,
    ) -> None:
        if cache_entries < 0 or cache_max_chars < 0:
            raise ValueError(
                f"cache sizes must be >= 0, got {cache_entries} entries, {cache_max_chars} chars"
            )
        self.inner = tokenizer
        self._fast = tokenizer if isinstance(tokenizer, FastPromptTokenizer) else None
        self._backend = None if self._fast is None else self._fast.fast_backend
        self.composes = self._backend is not None and PrefixReuse.supports(self._backend)
        """Whether ids of text cut at a valid boundary compose (:mod:`kvmesh.router.prefix_tokens`)."""
        self.prefixes: PrefixReuse | None = (
            PrefixReuse(self._backend) if prefix_reuse and self.composes else None
        )
        self._cache: OrderedDict[tuple[int, str | bytes], PromptIds] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_entries = cache_entries
        self.cache_max_chars = cache_max_chars
        self.num_hits = 0
        self.num_misses = 0

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt (same as the wrapped tokenizer's ``encode``)."""
        found = self.encode_ids(text, add_special_tokens=add_special_tokens)
        assert found is not None, "encode_ids without max_chars always tokenizes"
        return found.array.tolist()

    def encode_ids(
        self, text: str, *, add_special_tokens: bool = True, max_chars: int | None = None
    ) -> PromptIds | None:
        """:meth:`encode`'s ids packed as u32, with the learnt prefix they start with.

        Args:
            text: the prompt.
            add_special_tokens: whether the tokenizer adds its special tokens in front.
            max_chars: tokenize at most this many characters here (what a cache hit or a learnt
                prefix provides is not counted); ``None`` when more would be needed.
        """
        key = (int(add_special_tokens), text)
        ids = self._lookup(key, len(text))
        if ids is None:
            ids = self._encode(text, add_special_tokens, max_chars)
            if ids is None:
                return None
            self._store(key, len(text), ids)
        return ids

    def apply_chat_template(
        self, messages: Any, *, add_generation_prompt: bool = True, tools: Any = None
    ) -> list[int]:
        """Token ids of a chat (same as the wrapped tokenizer's ``apply_chat_template``); ``tools``
        (OpenAI function tools) are handed to the chat template only when there are some, so
        tokenizers that take no tools serve tool-free chats."""
        found = self.chat_ids(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        assert found is not None, "chat_ids without max_chars always tokenizes"
        return found.array.tolist()

    def chat_ids(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        tools: Any = None,
        max_chars: int | None = None,
    ) -> PromptIds | None:
        """:meth:`apply_chat_template`'s ids packed as u32, with the learnt prefix they start with;
        ``None`` when more than ``max_chars`` characters of the rendered chat would be tokenized
        (without a fast tokenizer: when its JSON form is longer)."""
        try:
            raw = msgspec.json.encode([messages, tools] if tools else messages)
        except (TypeError, msgspec.EncodeError):
            raw = b""
        key = (2 + int(add_generation_prompt), raw)
        size = len(raw) if raw else self.cache_max_chars + 1
        ids = self._lookup(key, size)
        if ids is None:
            if self._fast is not None and self._backend is not None:
                # What Tokenizer.apply_chat_template does, with the fast encode.
                text = self._fast.render_chat(
                    messages,
                    add_generation_prompt=add_generation_prompt,
                    **({"tools": tools} if tools else {}),
                )
                ids = self._encode(text, False, max_chars)
                if ids is None:
                    return None
            else:
                if max_chars is not None and size > max_chars:
                    return None
                ids = PromptIds(
                    as_token_array(
                        self.inner.apply_chat_template(
                            messages,
                            add_generation_prompt=add_generation_prompt,
                            **({"tools": tools} if tools else {}),
                        )
                    )
                )
            self._store(key, size, ids)
        return ids

    def encode_piece(self, text: str, add_special_tokens: bool) -> list[int]:
        """Ids of one piece of a longer text (no cache, no prefix reuse), where :attr:`composes`."""
        assert self._backend is not None, "encode_piece needs a fast backend (check composes first)"
        return list(self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)

    def render_chat(self, messages: Any, *, tools: Any = None) -> str | None:
        """The chat template's text for ``messages`` with a generation prompt, as
        :meth:`apply_chat_template` tokenizes it; ``None`` without a fast tokenizer."""
        if self._fast is None:
            return None
        return self._fast.render_chat(
            messages, add_generation_prompt=True, **({"tools": tools} if tools else {})
        )

    def _encode(self, text: str, add_special_tokens: bool, max_chars: int | None) -> PromptIds | None:
        if self.prefixes is not None:
            return self.prefixes.encode_ids(text, add_special_tokens, max_chars)
        if max_chars is not None and len(text) > max_chars:
            return None
        if self._backend is None:
            return PromptIds(as_token_array(self.inner.encode(text, add_special_tokens=add_special_tokens)))
        return PromptIds(
            as_token_array(
                self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
            )
        )

    def _lookup(self, key: tuple[int, str | bytes], size: int) -> PromptIds | None:
        if self.cache_entries == 0 or size > self.cache_max_chars:
            return None
        with self._lock:
            ids = self._cache.get(key)
            if ids is None:
                self.num_misses += 1
                return None
            self._cache.move_to_end(key)
            self.num_hits += 1
            return ids

    def _store(self, key: tuple[int, str | bytes], size: int, ids: PromptIds) -> None:
        if self.cache_entries == 0 or size > self.cache_max_chars:
            return
        with self._lock:
            self._cache[key] = ids
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)

    def __len__(self) -> int:
        return len(self._cache)

    def stats(self) -> dict[str, int | bool]:
        """Counters for ``GET /admin/index``: exact-cache use and shared-prefix reuse."""
        reuse = self.prefixes
        return {
            "cache_entries": len(self._cache),
            "cache_hits": self.num_hits,
            "cache_misses": self.num_misses,
            "prefix_reuse": reuse is not None,
            "prefixes_learnt": reuse.num_learnt if reuse is not None else 0,
            "prefixes_reused": reuse.num_reused if reuse is not None else 0,
            "prefixes_rejected": reuse.num_rejected if reuse is not None else 0,
        }
