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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.errors import ConfigError

DEFAULT_CAPACITY_BLOCKS = 16_384
"""Blocks kept (8.4M tokens of 512-token blocks, about 70 MB): a block is redrawn when it is reused
after this many other blocks."""

_MAX_INTERNED = 1 << 20
"""Vocabularies up to this size share one int object per token id."""


def block_token_array(
    seed: int, hash_id: int, num_tokens: int, vocab_size: int, token_low: int
) -> np.ndarray:
    """Block ``hash_id``'s tokens: what ``synthetic_tokens(random.Random(f"{seed}:{hash_id}"), ...)`` draws.

    ``randrange(low, high)`` takes ``getrandbits(k)`` (``k`` = bit length of ``high - low``) and
    retries while the draw is ``>= high - low``; for ``k <= 32`` a draw is the top ``k`` bits of one
    32-bit Mersenne Twister output, and ``getrandbits(32 * m)`` returns the next ``m`` outputs as
    little-endian words. So the accepted draws of a bulk read, in order, are the tokens.

    Returns:
        ``num_tokens`` ids in ``[token_low, vocab_size)`` (uint32; uint64 for ids past 32 bits).
    """
    span = vocab_size - token_low
    if span <= 0:
        raise ConfigError(f"vocab_size ({vocab_size}) must exceed token_low ({token_low})")
    rng = random.Random(f"{seed}:{hash_id}")
    bits = span.bit_length()
    if bits > 32:
        return np.array([rng.randrange(token_low, vocab_size) for _ in range(num_tokens)], dtype=np.uint64)
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
    tokens = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return (tokens[:num_tokens] + np.uint32(token_low)).astype(np.uint32)


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
        if vocab_size <= token_low:
            raise ConfigError(f"vocab_size ({vocab_size}) must exceed token_low ({token_low})")
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
        tokens = block_token_array(self.seed, hash_id, self.block_tokens, self.vocab_size, self.token_low)
        ints = self._ints
        found = (ints[tokens - self.token_low] if ints is not None else tokens).tolist()
        self.num_drawn += 1
        blocks[hash_id] = found
        if len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
        return found

    def tokens(self, hash_ids: Sequence[int], num_tokens: int) -> list[int]:
        """The first ``num_tokens`` tokens of the blocks ``hash_ids``, in one new list.

        Raises:
            ValueError: the blocks hold fewer than ``num_tokens`` tokens.
        """
        if num_tokens > len(hash_ids) * self.block_tokens:
            raise ValueError(f"{num_tokens} tokens exceed {len(hash_ids)} blocks of {self.block_tokens}")
        out: list[int] = []
        size = self.block_tokens
        for h in hash_ids:
            left = num_tokens - len(out)
            if left <= 0:
                break
            block = self.block(h)
            out.extend(block if left >= size else block[:left])
        return out


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt as a chain of shared token blocks: the first ``num_tokens`` tokens of ``hash_ids``.

    Holds no tokens itself; :meth:`token_ids` builds them from ``source``. Only the blocks that
    ``num_tokens`` reaches are listed.
    """

    hash_ids: tuple[int, ...]
    num_tokens: int
    source: BlockTokens

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def block_tokens(self) -> int:
        return self.source.block_tokens

    def token_ids(self) -> list[int]:
        """The prompt's tokens, in a new list."""
        return self.source.tokens(self.hash_ids, self.num_tokens)

    def block_lengths(self) -> list[int]:
        """Tokens of each listed block in the prompt (all full but possibly the last)."""
        size = self.source.block_tokens
        return [min(size, self.num_tokens - i * size) for i in range(len(self.hash_ids))]
