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

Layout: an LRU over every cached block of the fleet (1.5M blocks for 8 × 3M tokens of 16-token
blocks) as an ordered map would cost about 190 bytes a block. Instead each block names the request
that touched it last, and the requests form a log, oldest first::

    _last:  key ──► its last toucher        _log:  | req 7 | req 9 | req 12 | ...  (observe order)
                                                      └─ keys in touch order (tail first); a key is
                                                         live here only while _last names req 7

Touching a key again only repoints it, so the map never moves an entry; a request's list is
compacted once fewer than half its keys are still its own, and dropped when none is. Eviction walks
the log from the oldest request, skipping keys touched since: the same order as moving each touched
key to the end of one ordered map.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

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


@dataclass(slots=True, eq=False)
class _Touches:
    """The blocks one request touched, in touch order, from ``start`` on."""

    keys: list[BlockKey]
    live: int = 0
    """Keys whose last touch this is (still cached)."""
    start: int = 0
    """Keys before this one were evicted or touched again."""


_COMPACT_MIN = 64
"""Lists shorter than this are never compacted (their dead keys cost less than the pass)."""


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
        self._last: dict[BlockKey, _Touches] = {}
        self._log: deque[_Touches] = deque()
        self.num_requests = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, key: object) -> bool:
        return key in self._last

    def observe(self, keys: Sequence[BlockKey], prompt_len: int) -> int:
        """Serve one request and cache its blocks.

        Args:
            keys: the prompt's full-block keys, from its first block.
            prompt_len: the prompt's tokens (at least ``len(keys) * block_size``).

        Returns:
            Prompt tokens served from the cache.
        """
        last = self._last
        limit = min(len(keys), max(prompt_len - 1, 0) // self.block_size)
        matched = 0
        while matched < limit and keys[matched] in last:
            matched += 1
        hit = matched * self.block_size
        self.num_requests += 1
        self.prompt_tokens += prompt_len
        self.hit_tokens += hit
        if keys:
            self._touch(keys)
        # An LRU cache holds the most recent blocks whenever it evicts, so evicting once is exact.
        if len(last) > self.capacity_blocks:
            self._evict(len(last) - self.capacity_blocks)
        return hit

    def _touch(self, keys: Sequence[BlockKey]) -> None:
        """Make ``keys`` the most recent, tail first."""
        last = self._last
        order = list(reversed(keys))
        if len(set(order)) < len(order):  # a key named twice sits where its later touch puts it
            order = list(dict.fromkeys(keys))[::-1]
        touches = _Touches(order, len(order))
        before = list(map(last.get, order))
        last.update(zip(order, repeat(touches)))
        for old, n in Counter(before).items():
            if old is None:
                continue
            old.live -= n
            if not old.live:
                old.keys = []
                old.start = 0
            elif old.live * 2 < len(old.keys) - old.start and len(old.keys) >= _COMPACT_MIN:
                old.keys = [k for k in old.keys[old.start :] if last.get(k) is old]
                old.start = 0
        self._log.append(touches)

    def _evict(self, n: int) -> None:
        """Drop the ``n`` least recently touched keys."""
        last, log = self._last, self._log
        while n:
            oldest = log[0]
            keys = oldest.keys
            i = oldest.start
            while n and i < len(keys):
                key = keys[i]
                i += 1
                if last.get(key) is oldest:
                    del last[key]
                    oldest.live -= 1
                    n -= 1
            oldest.start = i
            if not oldest.live:
                log.popleft()

    def result(self) -> IdealCacheResult:
        """Totals so far."""
        return IdealCacheResult(
            capacity_tokens=self.capacity_tokens,
            block_size=self.block_size,
            num_requests=self.num_requests,
            prompt_tokens=self.prompt_tokens,
            hit_tokens=self.hit_tokens,
        )
