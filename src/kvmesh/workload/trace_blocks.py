"""Token blocks of hash-id traces: generated on demand, shared, and kept in a bounded LRU.

A Mooncake-format trace names each 512-token block of a prompt by a hash id; equal ids are equal
blocks. A prompt is therefore a short tuple of ids, and its tokens only need to exist while
something reads them::

    PromptBlocks(hash_ids=(7, 8, 12), num_tokens=1300)
        │ token_ids()
        ▼
    BlockTokens.block(7) ++ block(8) ++ block(12)[:276]      each block: one list, shared by every
                                                              prompt that uses it (LRU of blocks)

Block ``h`` holds the tokens ``synthetic_tokens(random.Random(f"{seed}:{h}"), ...)`` draws, so
every run and every replay tool sees the same tokens for the same id; :func:`block_token_array`
draws them in bulk instead of one ``randrange`` call per token. Cached blocks hold shared int
objects (one per vocabulary id), so a cached token costs a pointer, not an int object.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from kvmesh.errors import ConfigError
from kvmesh.workload.synthetic import check_token_range

DEFAULT_CAPACITY_BLOCKS = 16_384
"""Blocks kept (8.4M tokens of 512-token blocks, about 70 MB): a block is redrawn when it is reused
after this many other blocks. Replaying the bundled conversation trace (288,500 block reads, 182,790
distinct blocks) redraws 29,100 blocks at this size and 9,100 at twice it, about 0.6 s more (a draw
takes 30 µs)."""

_MAX_INTERNED = 1 << 20
"""Vocabularies up to this size share one int object per token id."""


def block_token_array(
    seed: int, hash_id: int, num_tokens: int, vocab_size: int, token_low: int
) -> np.ndarray:
    """Block ``hash_id``'s tokens: what ``synthetic_tokens(random.Random(f"{seed}:{hash_id}"), ...)`` draws.

    Returns:
        ``num_tokens`` ids in ``[token_low, vocab_size)`` (uint32; uint64 for ids past 32 bits).
    """
    check_token_range(vocab_size, token_low)
    draws = _draws(seed, hash_id, num_tokens, vocab_size - token_low)
    return draws + draws.dtype.type(token_low)


def _draws(seed: int, hash_id: int, num_tokens: int, span: int) -> np.ndarray:
    """The first ``num_tokens`` values ``randrange(span)`` returns for the PRNG of ``(seed, hash_id)``.

    ``randrange`` takes ``getrandbits(k)`` (``k`` = bit length of ``span``) and retries while the
    draw is ``>= span``; for ``k <= 32`` a draw is the top ``k`` bits of one 32-bit Mersenne Twister
    output, and ``getrandbits(32 * m)`` returns the next ``m`` outputs as little-endian words. So the
    accepted draws of a bulk read, in order, are the values.
    """
    rng = random.Random(f"{seed}:{hash_id}")
    bits = span.bit_length()
    if bits > 32:
        return np.array([rng.randrange(span) for _ in range(num_tokens)], dtype=np.uint64)
    if num_tokens <= 0:
        return np.empty(0, dtype=np.uint32)
    words = num_tokens + num_tokens // 16 + 16
    parts: list[np.ndarray] = []
    got = 0
    while got < num_tokens:
        raw = np.frombuffer(rng.getrandbits(32 * words).to_bytes(4 * words, "little"), dtype="<u4")
        draws = raw >> np.uint32(32 - bits)
        accepted = draws[draws < span]
        parts.append(accepted)
        got += accepted.size
    values = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return values[:num_tokens].astype(np.uint32, copy=False)


class BlockTokens:
    """The token list of each hash id, drawn on first use and kept while recently used.

    Args:
        block_tokens: tokens per block.
        seed: the trace replay's seed (see :func:`block_token_array`).
        vocab_size, token_low: token ids lie in ``[token_low, vocab_size)``.
        capacity_blocks: blocks kept; older ones are dropped and redrawn when needed again.
    """

    def __init__(
        self,
        block_tokens: int,
        *,
        seed: int = 0,
        vocab_size: int,
        token_low: int,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
    ) -> None:
        if block_tokens <= 0 or capacity_blocks <= 0:
            raise ConfigError(
                f"block_tokens and capacity_blocks must be > 0, got {block_tokens}, {capacity_blocks}"
            )
        check_token_range(vocab_size, token_low)
        self.block_tokens = block_tokens
        self.seed = seed
        self.vocab_size = vocab_size
        self.token_low = token_low
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, list[int]] = OrderedDict()
        self._ints: np.ndarray | None = None
        if vocab_size - token_low <= _MAX_INTERNED:
            self._ints = np.array(range(token_low, vocab_size), dtype=object)
        self.num_drawn = 0
        """Blocks drawn so far (first uses and redraws after eviction)."""

    def __len__(self) -> int:
        return len(self._blocks)

    def block(self, hash_id: int) -> list[int]:
        """Block ``hash_id``'s tokens. The list is shared: read it, never change it."""
        blocks = self._blocks
        found = blocks.get(hash_id)
        if found is not None:
            blocks.move_to_end(hash_id)
            return found
        draws = _draws(self.seed, hash_id, self.block_tokens, self.vocab_size - self.token_low)
        ints = self._ints
        found = (ints[draws] if ints is not None else draws + draws.dtype.type(self.token_low)).tolist()
        self.num_drawn += 1
        blocks[hash_id] = found
        if len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
        return found

    def block_array(self, hash_id: int) -> np.ndarray:
        """Block ``hash_id``'s tokens as a new read-only array (the cache keeps only the list)."""
        tokens = self.block(hash_id)
        array = np.array(tokens, dtype=np.uint32 if self.vocab_size <= 1 << 32 else np.uint64)
        array.flags.writeable = False
        return array

    def tokens(self, hash_ids: Sequence[int], start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of the concatenated blocks ``hash_ids``, in one new list.

        Raises:
            ValueError: the range is not inside the blocks.
        """
        size = self.block_tokens
        if not 0 <= start <= stop <= len(hash_ids) * size:
            raise ValueError(f"tokens [{start}, {stop}) are not inside {len(hash_ids)} blocks of {size}")
        out: list[int] = []
        for b in range(start // size, -(-stop // size)):
            block = self.block(hash_ids[b])
            lo, hi = max(start - b * size, 0), min(stop - b * size, size)
            out.extend(block if lo == 0 and hi == size else block[lo:hi])
        return out


@dataclass(frozen=True, slots=True)
class PromptBlocks(Sequence[int]):
    """A prompt as a chain of shared token blocks: the first ``num_tokens`` tokens of ``hash_ids``.

    Holds no tokens itself: indexing and slicing build them from ``source`` (a slice is a new list
    of just that range), and :meth:`token_ids` builds them all. Only the blocks that ``num_tokens``
    reaches are listed.
    """

    hash_ids: tuple[int, ...]
    num_tokens: int
    source: BlockTokens

    def __len__(self) -> int:
        return self.num_tokens

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.num_tokens)
            if step != 1:
                return self.token_ids()[index]
            return self.source.tokens(self.hash_ids, start, max(start, stop))
        i = index + self.num_tokens if index < 0 else index
        if not 0 <= i < self.num_tokens:
            raise IndexError(f"token {index} of a {self.num_tokens}-token prompt")
        size = self.source.block_tokens
        return self.source.block(self.hash_ids[i // size])[i % size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.token_ids())

    def token_ids(self) -> list[int]:
        """The prompt's tokens, in a new list."""
        return self.source.tokens(self.hash_ids, 0, self.num_tokens)
