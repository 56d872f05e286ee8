"""Streaming detokenization that costs O(new tokens) per step, and stop-string matching.

Decoding the whole output on every token is quadratic; long emulated streams on a small machine
cannot afford it. Like vLLM, only a short window is decoded: the text of ``ids[prefix:]`` minus the
text of ``ids[prefix:read]`` is the new text, held back while it ends in an incomplete UTF-8
sequence (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class StreamDetokenizer:
    """Text deltas of a growing token list."""

    def __init__(self, tokenizer: _Decoder) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, ids: Sequence[int]) -> str:
        """Append ``ids``; return the text they complete (possibly empty)."""
        self._ids.extend(ids)
        window = self._tok.decode(self._ids[self._prefix :])
        if window.endswith("\ufffd"):
            return ""
        before = self._tok.decode(self._ids[self._prefix : self._read])
        delta = window[len(before) :] if window.startswith(before) else window
        self._prefix = self._read
        self._read = len(self._ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character comes out as U+FFFD)."""
        window = self._tok.decode(self._ids[self._prefix :])
        before = self._tok.decode(self._ids[self._prefix : self._read])
        self._prefix = self._read = len(self._ids)
        return window[len(before) :] if window.startswith(before) else window


class StopMatcher:
    """Finds the first stop string in streamed text and holds back text that may begin one.

    ``feed`` returns the text safe to emit and whether a stop string was hit; on a hit the text
    before the stop string is emitted and the stop string itself is not (OpenAI semantics).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._pending + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return buf[: min(hits)]
        if final or self._hold == 0:
            self._pending = ""
            return buf
        cut = max(0, len(buf) - self._hold)
        self._pending = buf[cut:]
        return buf[:cut]
