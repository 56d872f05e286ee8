"""A request's cached prefix per pod, from the block index.

Keys are hashed lazily, a few blocks at a time, and the index walk stops at the first block no pod
holds, so a cold 8k-token prompt costs one or two hash groups instead of 512 digests.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from kvmesh.core.hashing import BlockHasher, as_token_array
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.router.index import SHARED_TIER_HOLDER, BlockIndex, Holders, MediumSet, best_medium
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.known_prefix import KnownPrefix
from kvmesh.router.types import PodMatch, PrefixMatch

DEFAULT_TIER_WEIGHTS: dict[Medium, float] = {
    Medium.GPU: 1.0,
    Medium.CPU: 0.8,
    Medium.DISK: 0.6,
    Medium.SHARED: 0.5,
}
"""How much one cached block is worth by tier, relative to a device-resident block."""

_FIRST_GROUP = 2
_MAX_GROUP = 128
_HEAD_BLOCKS = 2


def iter_block_keys(
    hasher: BlockHasher,
    tokens: Sequence[int] | np.ndarray,
    memo: BlockKeyMemo | None = None,
    known: KnownPrefix | None = None,
) -> Iterator[BlockKey]:
    """Yield the chained keys of ``tokens``' full blocks, lazily.

    Blocks of ``known`` (a learnt prefix whose ids lead ``tokens``) come from its kept keys,
    extended only as far as they are consumed; blocks found in ``memo`` cost a dict probe; the
    rest are hashed in groups that double in size (2, 4, 8, ... 128 blocks), so a cold prompt costs
    a couple of digests and a long cached one few calls into the hasher. Keys are produced a group
    at a time and flattened in C.
    """
    return itertools.chain.from_iterable(_iter_key_groups(hasher, tokens, memo, known))


def _iter_key_groups(
    hasher: BlockHasher,
    tokens: Sequence[int] | np.ndarray,
    memo: BlockKeyMemo | None,
    known: KnownPrefix | None = None,
) -> Iterator[list[BlockKey]]:
    bs = hasher.block_size
    end = hasher.num_full_blocks(len(tokens)) * bs
    if end == 0:
        return
    parent: BlockKey | None = None
    group = _FIRST_GROUP
    first = 0
    if known is not None:
        num_known = min(len(known), end) // bs
        while first < num_known:
            kept = known.leading_keys(hasher, min(first + group, num_known))
            stop = min(len(kept), num_known)
            yield kept[first:stop]
            parent = kept[stop - 1]
            first, group = stop, min(group * 2, _MAX_GROUP)
        first *= bs
    walking = memo is not None
    head = min(end, first + _HEAD_BLOCKS * bs)
    # Converting a long prompt costs more than hashing its first blocks: a cold prompt stops
    # being consumed within the head, so only the head is converted before that is known.
    for seg_start, seg_end in ((first, head), (head, end)):
        if seg_start >= seg_end:
            break
        # The tail is a view of the whole prompt converted once (a list slice would copy it first).
        arr = (
            as_token_array(tokens[seg_start:seg_end])
            if seg_start == first
            else as_token_array(tokens)[seg_start:seg_end]
        )
        n = seg_end - seg_start
        off = 0
        if walking:
            assert memo is not None
            walked = memo.walk(hasher.root if parent is None else parent, arr.tobytes(), bs * 4)
            if walked:
                yield walked
                parent = walked[-1]
                off = len(walked) * bs
            walking = off == n
        while off < n:
            stop = min(off + group * bs, n)
            keys = hasher.hash_blocks(arr[off:stop], parent)
            yield keys
            parent = keys[-1]
            off, group = stop, min(group * 2, _MAX_GROUP)


def match_prefix(
    index: BlockIndex,
    hasher: BlockHasher,
    tokens: Sequence[int] | np.ndarray,
    memo: BlockKeyMemo | None = None,
    known: KnownPrefix | None = None,
) -> PrefixMatch:
    """Per-pod consecutive cached blocks of ``tokens``.

    Args:
        index: the block index.
        hasher: the request's namespace hasher (same block size and digest as the engines).
        tokens: prompt token ids.
        memo: keys already computed from event tokens (optional; only speeds things up).
        known: a learnt prefix whose ids lead ``tokens`` (optional; its keys are kept).

    Returns:
        A :class:`PrefixMatch`; a pod appears when it holds at least block 0.
    """
    num_blocks = hasher.num_full_blocks(len(tokens))
    if num_blocks == 0:
        return PrefixMatch(0, hasher.block_size)
    return match_prefix_keys(
        index, iter_block_keys(hasher, tokens, memo, known), num_blocks, hasher.block_size
    )


def match_prefix_keys(
    index: BlockIndex, keys: Iterable[BlockKey], num_blocks: int, block_size: int
) -> PrefixMatch:
    """:func:`match_prefix` for a caller that already holds the prompt's block keys.

    Args:
        index: the block index.
        keys: the prompt's block keys in chain order (consumed only as far as some pod matches).
        num_blocks: full blocks in the prompt.
        block_size: tokens per block.
    """
    result = PrefixMatch(num_blocks, block_size)
    if num_blocks == 0:
        return result
    holders_chain = index.lookup(keys)
    if not holders_chain:
        return result
    # A pod's match is the run of blocks from 0 it holds; usually every block of it sits in the
    # same tiers, so one PodMatch with a single tier. MediumSet values are never 0 (an emptied
    # entry is deleted), so a falsy value ends the run.
    pods = result.pods
    if len(holders_chain) <= _SHORT_CHAIN:
        for pod, first in holders_chain[0].items():
            total = 0
            mixed = False
            for holders in holders_chain:
                mask = holders.get(pod)
                if not mask:
                    break
                if mask != first:
                    mixed = True
                total += 1
            pods[pod] = (
                _tier_counts(holders_chain, pod, total)
                if mixed
                else PodMatch(total, {best_medium(first): total})
            )
    else:
        for pod, first in holders_chain[0].items():
            # Long chains: map/takewhile keep the per-block work in C.
            masks: list[MediumSet] = list(
                itertools.takewhile(bool, map(dict.get, holders_chain, itertools.repeat(pod)))  # type: ignore[arg-type]
            )
            total = len(masks)
            if masks.count(first) == total:
                pods[pod] = PodMatch(total, {best_medium(first): total})
            else:
                pods[pod] = _tier_counts(holders_chain, pod, total)
    shared = pods.pop(SHARED_TIER_HOLDER, None)
    if shared is not None:
        _extend_with_shared(result, shared)
    return result


def _extend_with_shared(result: PrefixMatch, shared: PodMatch) -> None:
    """Record the shared tier's match and run every shorter pod match on through it: an engine
    uses what it finds on its device, then loads what the shared tier holds beyond that. Only the
    shared tier's run from the prompt's start counts, because a store serves prefixes (its lookup
    stops at the first chunk it lacks)."""
    shared.blocks_by_tier = {Medium.SHARED: shared.num_blocks}
    result.shared = shared
    for match in result.pods.values():
        extra = shared.num_blocks - match.num_blocks
        if extra > 0:
            match.num_blocks = shared.num_blocks
            match.blocks_by_tier[Medium.SHARED] = match.blocks_by_tier.get(Medium.SHARED, 0) + extra


_SHORT_CHAIN = 24
"""Up to this many matched blocks a Python loop per pod beats the C pipeline (measured)."""


def _tier_counts(holders_chain: list[Holders], pod: PodId, total: int) -> PodMatch:
    match = PodMatch()
    for mask, n in collections.Counter(h[pod] for h in holders_chain[:total]).items():
        tier = best_medium(MediumSet(mask))
        match.num_blocks += n
        match.blocks_by_tier[tier] = match.blocks_by_tier.get(tier, 0) + n
    return match


def weighted_blocks(match: PodMatch, tier_weights: Mapping[Medium, float] = DEFAULT_TIER_WEIGHTS) -> float:
    """Matched blocks, each counted at its tier's weight."""
    by_tier = match.blocks_by_tier
    if len(by_tier) == 1:  # the usual case; the same value sum() gives (0 + x == x)
        for tier, n in by_tier.items():
            return 0 + n * tier_weights.get(tier, 0.0)
    return sum(n * tier_weights.get(tier, 0.0) for tier, n in match.blocks_by_tier.items())
