"""What the router remembers to explain a cache miss: blocks it saw come and go, texts it tokenized.

Both memories are keyed by values that carry the request's namespace (model, LoRA, tenant), so a
lookup for one tenant can only ever find what that tenant's own requests and blocks left there:

* :class:`SeenBlocks`: router block keys (chained from a namespace root) → the tiers a block was
  last held in and when it was removed. Fed by :class:`RememberingIndex`, the index the event
  applier writes through.
* :class:`TextPrints`: fingerprints of a prompt's leading text (seeded with the namespace root) →
  the token ids of the first block those words were tokenized into.

Both are bounded dicts: past capacity the entries inserted first leave first.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.router.index import ALL_MEDIA, BlockIndex, Holders, IndexStats, MediumSet, media_of

_TRIM_FRACTION = 16
"""Past capacity, a sixteenth more than the excess leaves at once (trims stay rare)."""


def _trim(entries: dict[Any, Any], capacity: int) -> None:
    excess = len(entries) - capacity
    if excess <= 0:
        return
    oldest = list(itertools.islice(entries, excess + capacity // _TRIM_FRACTION))
    collections.deque(map(entries.__delitem__, oldest), maxlen=0)  # deleted in C


@dataclass(slots=True, frozen=True)
class BlockSighting:
    """What :class:`SeenBlocks` knows of one block.

    Attributes:
        added_at: ``time.monotonic()`` of its latest add (0: none remembered).
        media: the tiers of that add (a :data:`MediumSet`).
        removed_at: ``time.monotonic()`` of its latest removal (0: none remembered).
        removed_media: the tiers named by that removal (0: every tier, as a flush names them).
    """

    added_at: float
    media: int
    removed_at: float = 0.0
    removed_media: int = 0

    def seen_before(self, when: float) -> bool:
        """Whether the block was added or removed before ``when``."""
        return 0 < self.removed_at < when or 0 < self.added_at < when

    @property
    def tier(self) -> Medium:
        """The slowest tier of its latest removal, else of its latest add: where it was last seen."""
        bits = self.removed_media or self.media
        return media_of(MediumSet(bits))[-1] if bits else Medium.GPU


_Note = tuple[float, int]
"""(monotonic time, MediumSet bits) of a block's latest add or removal."""


class SeenBlocks:
    """Bounded memory of router block keys the index held at some point.

    Adds and removals are kept apart, each a dict of at most ``capacity`` keys written at C speed
    (one shared record per call): a block recomputed after its eviction keeps its removal.

    Args:
        capacity: keys kept per kind, adds and removals (0: remember nothing).
        clock: monotonic seconds.
    """

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.clock = clock
        self._added: dict[BlockKey, _Note] = {}
        self._removed: dict[BlockKey, _Note] = {}

    def __len__(self) -> int:
        return len(self._added) + len(self._removed)

    def get(self, key: BlockKey) -> BlockSighting | None:
        """What is known of ``key`` (``None``: never seen, or forgotten)."""
        added, removed = self._added.get(key), self._removed.get(key)
        if added is None and removed is None:
            return None
        added_at, media = added if added is not None else (0.0, 0)
        removed_at, removed_media = removed if removed is not None else (0.0, 0)
        return BlockSighting(added_at, media, removed_at, removed_media)

    def note_added(self, keys: Sequence[BlockKey], media: MediumSet) -> None:
        """``keys`` are now held in the tiers ``media``."""
        if self.capacity:
            added = self._added
            added.update(zip(keys, itertools.repeat((self.clock(), int(media)))))
            if len(added) > self.capacity:
                _trim(added, self.capacity)

    def note_removed(self, keys: Sequence[BlockKey], media: MediumSet) -> None:
        """``keys`` left the tiers ``media`` (of some holder)."""
        if self.capacity:
            bits = 0 if media == ALL_MEDIA else int(media)
            removed = self._removed
            removed.update(zip(keys, itertools.repeat((self.clock(), bits))))
            if len(removed) > self.capacity:
                _trim(removed, self.capacity)


class RememberingIndex:
    """A :class:`BlockIndex` that tells a :class:`SeenBlocks` what is added and removed.

    The event applier writes through it; lookups pass straight to ``inner``.

    Args:
        inner: the index.
        seen: the memory to feed.
    """

    def __init__(self, inner: BlockIndex, seen: SeenBlocks) -> None:
        self.inner = inner
        self.seen = seen

    def add(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet) -> None:
        self.inner.add(keys, pod, media)
        self.seen.note_added(keys, media)

    def remove(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet = ALL_MEDIA) -> None:
        self.inner.remove(keys, pod, media)
        self.seen.note_removed(keys, media)

    def lookup(self, keys: Iterable[BlockKey]) -> list[Holders]:
        return self.inner.lookup(keys)

    def clear_pod(self, pod: PodId) -> int | None:
        return self.inner.clear_pod(pod)

    def stats(self) -> IndexStats:
        return self.inner.stats()


if TYPE_CHECKING:
    _conforms: type[BlockIndex] = RememberingIndex

MIN_PRINT_BYTES = 256
"""Shorter shared text is not compared: the first block could run past it legitimately."""

_SEPARATOR = b"\x1f"


def prompt_texts(body: dict[str, Any], *, chat: bool) -> list[str]:
    """The text of a request in order: the prompt string, or each chat message's text content.

    Roles and the template are left out on purpose: the same words rendered into other ids is what
    :class:`TextPrints` is there to notice. Token-id prompts have no text (empty list).
    """
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return [prompt] if isinstance(prompt, str) else []
    out: list[str] = []
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    out.append(text)
    return out


def text_prints(seed: bytes, texts: Sequence[str]) -> list[bytes]:
    """Fingerprints of the texts' leading bytes at 256, 512, 1024, ... bytes and at their end,
    shortest first; each is seeded with ``seed`` (the namespace root key)."""
    if len(texts) == 1:  # a completion's prompt: no join, no second copy
        data = texts[0].encode("utf-8", "surrogatepass")
    else:
        data = _SEPARATOR.join([t.encode("utf-8", "surrogatepass") for t in texts])
    if len(data) < MIN_PRINT_BYTES:
        return []
    view = memoryview(data)
    # xxh3's digest leaves the running state as it is: no copy per print (blake2b needed one).
    digest = xxhash.xxh3_128(seed)
    prints: list[bytes] = []
    start, stop = 0, MIN_PRINT_BYTES
    while True:
        stop = min(stop, len(data))
        digest.update(view[start:stop])
        prints.append(digest.digest())
        if stop == len(data):
            return prints
        start, stop = stop, stop * 2


class TextPrints:
    """Bounded memory: leading text (fingerprint) → the ids of the first block it was tokenized into.

    Args:
        capacity: fingerprints kept (0: remember nothing).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._first_keys: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self._first_keys)

    def tokenized_otherwise(self, prints: Sequence[bytes], first_key: bytes) -> bool:
        """Whether the longest remembered leading text of ``prints`` was tokenized into a first
        block other than ``first_key`` (its token ids as bytes)."""
        known = self._first_keys
        for fp in reversed(prints):
            key = known.get(fp)
            if key is not None:
                return key != first_key
        return False

    def remember(self, prints: Sequence[bytes], first_key: bytes) -> None:
        """The texts behind ``prints`` were tokenized into a prompt whose first block's ids are
        ``first_key``."""
        if not self.capacity or not prints:
            return
        known = self._first_keys
        for fp in prints:
            known.pop(fp, None)  # the latest tokenization moves last
            known[fp] = first_key
        _trim(known, self.capacity)
