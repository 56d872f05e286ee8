"""Reuse of a shared prompt prefix's token ids, where the tokenizer provably allows it.

Prompts that differ only after a long shared part (a system prompt, few-shot examples) spend
most of their tokenization on that part. For byte-level BPE tokenizers of the GPT-2 family the
ids of ``A + B`` are ``ids(A) + ids(B)`` when the cut between ``A`` and ``B`` is a pre-token
boundary, because

* added (special) tokens are split out first; none contains whitespace or strips its
  neighbours, so none can span a cut that has a space on its right;
* the pre-tokenizer regex (``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|
  \\s+(?!\\S)|\\s+``) looks only rightwards and every alternative that can hold a non-space
  character holds no whitespace after its first character: with a printable non-space ASCII
  character before the cut and a plain space after it, no match crosses the cut, the matches in
  ``A`` do not look past it, and matching restarts at the cut exactly as in ``B`` alone;
* BPE merges act within one pre-token, and the post-processor only puts special tokens in front.

:meth:`PrefixReuse.supports` checks those properties on the tokenizer's own description and
enables nothing otherwise. On top of the argument, every prefix is checked once before it is
kept: the prompt that produced it is tokenized in full and must equal the composed ids.

Prefixes are learnt from pairs of prompts that share their first ``key_chars`` characters: the
longest common part, cut back to the last valid boundary, becomes a prefix when it is at least
``min_chars`` long. Memory is bounded by ``max_keys`` groups of a few prefixes each, and by
``max_chars`` characters over all of them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvmesh.core.hashing import as_token_array
from kvmesh.router.known_prefix import KnownPrefix, PromptIds, join_ids

_MAX_PER_KEY = 4

DEFAULT_MAX_CHARS = 16_000_000
"""Characters of prefixes and prompts kept (with their ids, some 150 MB at worst)."""


def valid_cut(text: str, cut: int) -> bool:
    """Whether ids of ``text[:cut]`` followed by those of ``text[cut:]`` are the ids of ``text``
    (on a tokenizer :meth:`PrefixReuse.supports`): a plain space after a printable ASCII character."""
    return 0 < cut < len(text) and text[cut] == " " and "!" <= text[cut - 1] <= "~"


def _common_length(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b`` (C-level compares of windows that double,
    then a binary search inside the first window that differs; each character copied about twice)."""
    n = min(len(a), len(b))
    lo, size = 0, 256
    while lo < n:
        hi = min(lo + size, n)
        if a[lo:hi] != b[lo:hi]:
            # a[:lo] == b[:lo], and the first difference lies in [lo, hi)
            while lo < hi - 1:
                mid = (lo + hi) // 2
                if a[lo:mid] == b[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            return lo
        lo, size = hi, size * 2
    return n


def _longest_of(prefixes: list[KnownPrefix], text: str) -> KnownPrefix | None:
    best: KnownPrefix | None = None
    for known in prefixes:
        prefix = known.text
        if (
            len(prefix) < len(text)
            and text[len(prefix)] == " "  # the cut must be valid in this prompt too
            and text.startswith(prefix)
            and (best is None or len(prefix) > len(best.text))
        ):
            best = known
    return best


class PrefixReuse:
    """Tokenizes a prompt as (known prefix ids) + (ids of the rest), learning prefixes as it goes.

    Args:
        backend: a ``tokenizers.Tokenizer`` for which :meth:`supports` is true.
        key_chars: prompts are grouped by this many leading characters.
        min_chars: shortest prefix worth keeping.
        max_keys: most groups kept, least recently used leaving first.
        max_chars: most characters of prefixes and recent prompts kept over all groups (long
            prompts' prefixes are large), least recently used groups leaving first.
    """

    def __init__(
        self,
        backend: Any,
        *,
        key_chars: int = 64,
        min_chars: int = 256,
        max_keys: int = 256,
        max_chars: int = DEFAULT_MAX_CHARS,
    ) -> None:
        if not 0 < key_chars <= min_chars:
            raise ValueError(f"need 0 < key_chars <= min_chars, got {key_chars}, {min_chars}")
        self._backend = backend
        self.key_chars = key_chars
        self.min_chars = min_chars
        self.max_keys = max_keys
        self.max_chars = max_chars
        self._chars = 0
        # (special, first key_chars) -> (prefixes, recent prompts)
        self._groups: OrderedDict[tuple[bool, str], tuple[list[KnownPrefix], list[str]]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_reused = 0
        self.num_learnt = 0
        self.num_rejected = 0

    @staticmethod
    def supports(backend: Any) -> bool:
        """Whether ``backend`` has the properties the composition argument needs."""
        try:
            spec = json.loads(backend.to_str())
        except (AttributeError, TypeError, ValueError):
            return False
        pre = spec.get("pre_tokenizer") or {}
        post = spec.get("post_processor")
        model = spec.get("model") or {}
        if spec.get("normalizer") is not None or model.get("type") != "BPE" or model.get("dropout"):
            return False
        if pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return False
        if post is not None and post.get("type") not in ("ByteLevel", "TemplateProcessing"):
            return False
        if post is not None and post.get("type") == "TemplateProcessing":
            single = post.get("single") or []
            if not single or "Sequence" not in single[-1]:
                return False  # special tokens after the text
        for added in spec.get("added_tokens") or []:
            content = added.get("content", " ")
            if added.get("lstrip") or added.get("rstrip") or any(c.isspace() for c in content):
                return False
        return True

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of ``text``, equal to a full ``encode`` of it."""
        found = self.encode_ids(text, add_special_tokens)
        assert found is not None, "encode_ids without max_chars always tokenizes"
        return found.array.tolist()

    def encode_ids(
        self, text: str, add_special_tokens: bool, max_chars: int | None = None
    ) -> PromptIds | None:
        """The ids of ``text`` packed as u32 (equal to a full ``encode`` of it), with the learnt
        prefix they start with.

        Args:
            text: the text.
            add_special_tokens: whether the tokenizer adds its special tokens in front.
            max_chars: tokenize at most this many characters (after a learnt prefix); ``None``
                when more would be needed (``None``: no limit).
        """
        if len(text) <= self.min_chars:
            if max_chars is not None and len(text) > max_chars:
                return None
            return PromptIds(as_token_array(self._full(text, add_special_tokens)))
        key = (add_special_tokens, text[: self.key_chars])
        with self._lock:
            group = self._groups.get(key)
            if group is not None:
                self._groups.move_to_end(key)
                prefixes, recent = group[0][:], group[1][:]
            else:
                prefixes, recent = [], []
        best = _longest_of(prefixes, text)
        if best is not None:
            if max_chars is not None and len(text) - len(best.text) > max_chars:
                return None
            self.num_reused += 1
            return join_ids(best, self._full(text[len(best.text) :], False))
        if max_chars is not None and len(text) > max_chars:
            return None
        ids = self._full(text, add_special_tokens)
        self._maybe_learn(key, text, ids, recent)
        return PromptIds(as_token_array(ids))

    def longest_known(self, text: str, add_special_tokens: bool) -> KnownPrefix | None:
        """The longest learnt prefix of ``text`` that ends at a valid cut in it (``None``: none)."""
        key = (add_special_tokens, text[: self.key_chars])
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                return None
            self._groups.move_to_end(key)
            prefixes = group[0][:]
        best = _longest_of(prefixes, text)
        if best is not None:
            self.num_reused += 1
        return best

    def learn_shared(self, text: str, add_special_tokens: bool, known_chars: int = 0) -> KnownPrefix | None:
        """Learn the longest part ``text`` shares with a recent prompt of its group, for a prompt
        that will not be tokenized in full (:mod:`kvmesh.router.first_miss`): that part, cut back
        to a valid boundary, is tokenized and kept when longer than ``known_chars``; otherwise
        ``text`` joins the recent prompts.

        Returns:
            The learnt prefix, or ``None``.
        """
        if len(text) <= self.min_chars:
            return None
        key = (add_special_tokens, text[: self.key_chars])
        with self._lock:
            group = self._groups.get(key)
            recent = [] if group is None else group[1][:]
        for other in recent:
            cut = _common_length(text, other)
            while cut > known_chars and cut >= self.min_chars and not valid_cut(text, cut):
                cut = text.rfind(" ", 0, cut)
            if cut <= known_chars or cut < self.min_chars:
                continue
            learnt = KnownPrefix(text[:cut], self._full(text[:cut], add_special_tokens))
            with self._lock:
                return self._add_locked(key, learnt)
        with self._lock:
            self._add_locked(key, None, recent=text)
        return None

    def remember(self, prefix: str, ids: Sequence[int] | np.ndarray, add_special_tokens: bool) -> None:
        """Keep ``prefix`` with its ids, composed from pieces cut at valid boundaries (the ids
        of a full encode, by the argument above), so later prompts that start with it skip it.
        Prefixes shorter than ``min_chars`` are not kept."""
        if len(prefix) < max(self.min_chars, self.key_chars):
            return
        key = (add_special_tokens, prefix[: self.key_chars])
        with self._lock:
            self._add_locked(key, KnownPrefix(prefix, ids))

    def _full(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)

    def _maybe_learn(self, key: tuple[bool, str], text: str, ids: list[int], recent: list[str]) -> None:
        learnt: KnownPrefix | None = None
        for other in recent:
            cut = _common_length(text, other)
            while cut >= self.min_chars and not valid_cut(text, cut):
                cut = text.rfind(" ", 0, cut)
            if cut < self.min_chars:
                continue
            prefix = text[:cut]
            prefix_ids = self._full(prefix, key[0])
            # The one full check: this prompt's own ids must equal the composition.
            if prefix_ids + self._full(text[cut:], False) != ids:
                self.num_rejected += 1
                continue
            learnt = KnownPrefix(prefix, prefix_ids)
            break
        with self._lock:
            if learnt is not None:
                self._add_locked(key, learnt)
            else:
                self._add_locked(key, None, recent=text)

    def _add_locked(
        self, key: tuple[bool, str], known: KnownPrefix | None, recent: str | None = None
    ) -> KnownPrefix | None:
        """Add a prefix (or, without one, a recent prompt) to ``key``'s group, then leave the
        limits. Holds ``_lock``.

        Returns:
            The group's prefix with ``known``'s text: ``known`` when it is new (counted as
            learnt), else the one kept before it (its keys already computed); ``None`` without one.
        """
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = ([], [])
        self._groups.move_to_end(key)
        prefixes, recent_list = group
        if known is not None:
            kept = next((p for p in prefixes if p.text == known.text), None)
            if kept is not None:
                return kept
            prefixes.append(known)
            self.num_learnt += 1
            self._chars += len(known.text) - sum(len(p.text) for p in prefixes[:-_MAX_PER_KEY])
            del prefixes[:-_MAX_PER_KEY]
        elif recent is not None:
            recent_list.append(recent)
            self._chars += len(recent) - sum(len(r) for r in recent_list[:-_MAX_PER_KEY])
            del recent_list[:-_MAX_PER_KEY]
        while len(self._groups) > 1 and (len(self._groups) > self.max_keys or self._chars > self.max_chars):
            _, (old_prefixes, old_recent) = self._groups.popitem(last=False)
            self._chars -= sum(len(p.text) for p in old_prefixes) + sum(len(r) for r in old_recent)
        return known
