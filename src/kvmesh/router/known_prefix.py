"""A learnt leading part of prompts, with what routing derives from its ids computed once.

Prompts that share a long start (a system prompt, a document) reuse that start's ids
(:mod:`kvmesh.router.prefix_tokens`). Each request then also needed those ids packed as u32 and
hashed into block keys, over and over: at ~98k tokens that was about a millisecond of router CPU
per request. A :class:`KnownPrefix` keeps the packed ids and, per hasher, the keys of its full
blocks, so a request that starts with it packs and hashes only its own rest::

    prompt ids = [ known.array | rest ]      keys = known.block_keys(hasher) + hash(rest blocks,
                                                     parent = last known key), from the last full
                                                     block of the prefix on

Block keys chain from the prompt's first block, so the keys of a prefix's full blocks are those of
every prompt that starts with its ids: nothing here approximates.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace, as_token_array
from kvmesh.core.types import BlockKey

MAX_HASHERS = 8
"""Key lists kept per prefix (one per namespace and block size: tenants, LoRA adapters, scorers);
beyond this the oldest is dropped and recomputed when asked again."""


class KnownPrefix:
    """A prefix's text and ids (packed once), and its block keys per hasher.

    Args:
        text: the prefix's characters.
        ids: its token ids (a full encode's leading ids).

    Attributes:
        text: the prefix's characters.
        array: its ids as a read-only u32 array.
    """

    __slots__ = ("_keys", "_lock", "array", "text")

    def __init__(self, text: str, ids: Sequence[int] | np.ndarray) -> None:
        array = np.array(ids, dtype="<u4") if isinstance(ids, np.ndarray) else as_token_array(ids)
        array.flags.writeable = False
        self.text = text
        self.array = array
        self._keys: dict[tuple[Namespace, int, HashAlgo], list[BlockKey]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Tokens in the prefix."""
        return len(self.array)

    def __repr__(self) -> str:
        return f"KnownPrefix({len(self.text)} chars, {len(self.array)} ids)"

    def block_keys(self, hasher: BlockHasher) -> list[BlockKey]:
        """The keys of the prefix's full blocks under ``hasher`` (computed once; do not mutate)."""
        return self.leading_keys(hasher, len(self.array) // hasher.block_size)

    def leading_keys(self, hasher: BlockHasher, num_blocks: int) -> list[BlockKey]:
        """The keys of at least the prefix's first ``num_blocks`` full blocks (all of them when it
        has fewer) under ``hasher``: the kept list, extended as far as asked (do not mutate it)."""
        slot = (hasher.namespace, hasher.block_size, hasher.algo)
        want = min(num_blocks, len(self.array) // hasher.block_size)
        keys = self._keys.get(slot)
        if keys is not None and len(keys) >= want:
            return keys
        with self._lock:
            keys = self._keys.get(slot)
            if keys is None:
                if len(self._keys) >= MAX_HASHERS:
                    del self._keys[next(iter(self._keys))]
                keys = self._keys[slot] = []
            have = len(keys)
            if have < want:
                bs = hasher.block_size
                # One extend: a reader on another thread sees the list before or after it.
                keys.extend(hasher.hash_blocks(self.array[have * bs : want * bs], keys[-1] if keys else None))
        return keys


def prompt_block_keys(
    hasher: BlockHasher, tokens: Sequence[int] | np.ndarray, known: KnownPrefix | None
) -> list[BlockKey]:
    """Every full block's key of ``tokens``, which start with ``known``'s ids when it is given:
    :meth:`BlockHasher.hash_blocks` of ``tokens``, with the prefix's blocks taken from its memo."""
    if known is None:
        return hasher.hash_blocks(tokens)
    n = len(known.array) // hasher.block_size
    if n == 0:
        return hasher.hash_blocks(tokens)
    head = known.block_keys(hasher)
    tail = hasher.hash_blocks(as_token_array(tokens)[n * hasher.block_size :], head[-1])
    return head + tail if tail else head[:]


@dataclass(slots=True, frozen=True)
class PromptIds:
    """A prompt's token ids as one u32 array, and the known prefix they start with.

    Attributes:
        array: the ids (shared with a cache: do not mutate).
        known: a :class:`KnownPrefix` whose ids lead ``array`` (``None``: none).
    """

    array: np.ndarray
    known: KnownPrefix | None = None


def join_ids(known: KnownPrefix | None, rest: Sequence[int]) -> PromptIds:
    """``known``'s ids followed by ``rest``, packed (only ``rest`` is converted)."""
    if known is None:
        return PromptIds(as_token_array(rest))
    if not rest:
        return PromptIds(known.array, known)
    return PromptIds(np.concatenate((known.array, as_token_array(rest))), known)
