"""The yardstick of a simulated fleet: one shared prefix cache as large as all its replicas together.

Requests are fed in the order the client sends them (a session's turn once the previous one
finished), with no timing: each one's prompt is matched against the cache as a prefix of block
keys (consecutive from its first block, as every tier matches), then all its full blocks become
the most recently used, tail first so that a prompt's head is evicted last
(as the device tier frees them). Hits follow the replicas' rule that the prompt's last token is
always computed: at most ``(prompt_len - 1) // block_size`` blocks count.

What it answers: how much of the workload a fleet-wide cache of the fleet's KV size could serve,
had routing no cost and pods no walls. It is a yardstick, not a bound: LRU is not an optimal
policy, a run with CPU or shared tiers holds more than its device KV, and queued requests see
a cache that timing has moved on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.core.types import BlockKey


@dataclass(frozen=True, slots=True)
class IdealCacheResult:
    """What the ideal shared cache served over a run."""

    capacity_tokens: int
    block_size: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the cache (0 when there were none)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class IdealSharedCache:
    """A prefix cache of ``capacity_tokens`` over block keys, least recently used block evicted first.

    Args:
        capacity_tokens: KV tokens it holds (rounded down to whole blocks).
        block_size: tokens per block.

    Raises:
        ValueError: a capacity below one block.
    """

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        if block_size <= 0 or capacity_tokens < block_size:
            raise ValueError(
                f"capacity_tokens={capacity_tokens} must hold one block of block_size={block_size}"
            )
        self.capacity_tokens = capacity_tokens
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._lru: OrderedDict[BlockKey, None] = OrderedDict()
        self.num_requests = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def observe(self, keys: Sequence[BlockKey], prompt_len: int) -> int:
        """Serve one request and cache its blocks.

        Args:
            keys: the prompt's full-block keys, from its first block.
            prompt_len: the prompt's tokens (at least ``len(keys) * block_size``).

        Returns:
            Prompt tokens served from the cache.
        """
        lru = self._lru
        limit = min(len(keys), max(prompt_len - 1, 0) // self.block_size)
        matched = 0
        while matched < limit and keys[matched] in lru:
            matched += 1
        hit = matched * self.block_size
        self.num_requests += 1
        self.prompt_tokens += prompt_len
        self.hit_tokens += hit
        move = lru.move_to_end
        for key in reversed(keys):
            if key in lru:
                move(key)
            else:
                lru[key] = None
        # An LRU cache holds the most recent blocks whenever it evicts, so evicting once is exact.
        for _ in range(len(lru) - self.capacity_blocks):
            lru.popitem(last=False)
        return hit

    def result(self) -> IdealCacheResult:
        """Totals so far."""
        return IdealCacheResult(
            capacity_tokens=self.capacity_tokens,
            block_size=self.block_size,
            num_requests=self.num_requests,
            prompt_tokens=self.prompt_tokens,
            hit_tokens=self.hit_tokens,
        )
