"""A request's cached prefix per pod, from the block index.

Keys are hashed lazily, a few blocks at a time, and the index walk stops at the first block no pod
holds, so a cold 8k-token prompt costs one or two hash groups instead of 512 digests.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from kvmesh.core.hashing import BlockHasher
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.router.index import BlockIndex, best_medium
from kvmesh.router.types import PodMatch, PrefixMatch

DEFAULT_TIER_WEIGHTS: dict[Medium, float] = {
    Medium.GPU: 1.0,
    Medium.CPU: 0.8,
    Medium.DISK: 0.6,
    Medium.SHARED: 0.5,
}
"""How much one cached block is worth by tier, relative to a device-resident block."""

_HASH_GROUP = 8


def iter_block_keys(
    hasher: BlockHasher, tokens: Sequence[int], group: int = _HASH_GROUP
) -> Iterator[BlockKey]:
    """Yield the chained keys of ``tokens``' full blocks, hashing ``group`` blocks at a time."""
    step = hasher.block_size * group
    parent: BlockKey | None = None
    for start in range(0, hasher.num_full_blocks(len(tokens)) * hasher.block_size, step):
        keys = hasher.hash_blocks(tokens[start : start + step], parent)
        yield from keys
        parent = keys[-1]


def match_prefix(
    index: BlockIndex,
    hasher: BlockHasher,
    tokens: Sequence[int],
) -> PrefixMatch:
    """Per-pod consecutive cached blocks of ``tokens``.

    Args:
        index: the block index.
        hasher: the request's namespace hasher (same block size and digest as the engines).
        tokens: prompt token ids.

    Returns:
        A :class:`PrefixMatch`; a pod appears when it holds at least block 0.
    """
    result = PrefixMatch(hasher.num_full_blocks(len(tokens)), hasher.block_size)
    if result.num_blocks == 0:
        return result
    holders_chain = index.lookup(iter_block_keys(hasher, tokens))
    if not holders_chain:
        return result
    pods = result.pods
    alive: set[PodId] = set(holders_chain[0])
    for pod in alive:
        pods[pod] = PodMatch()
    for holders in holders_chain:
        if len(alive) > len(holders) or not alive <= holders.keys():
            alive &= holders.keys()
            if not alive:
                break
        for pod in alive:
            tier = best_medium(holders[pod])
            match = pods[pod]
            match.num_blocks += 1
            match.blocks_by_tier[tier] = match.blocks_by_tier.get(tier, 0) + 1
    return result


def weighted_blocks(match: PodMatch, tier_weights: Mapping[Medium, float] = DEFAULT_TIER_WEIGHTS) -> float:
    """Matched blocks, each counted at its tier's weight."""
    return sum(n * tier_weights.get(tier, 0.0) for tier, n in match.blocks_by_tier.items())
