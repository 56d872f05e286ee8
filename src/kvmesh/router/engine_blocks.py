"""Engine blocks larger than the router's: matches rounded to what each engine can reuse.

Each pod's block size is learned from its BlockStored events
(:meth:`~kvmesh.router.ingest.EventApplier.pod_block_size`). A pod whose blocks are ``k`` times the
router's (vLLM on CPU uses 128 tokens, the router 16) has each engine block re-hashed into ``k``
router blocks::

    engine hash ──► (last sub-key, namespace id, MediumSet)     chains continue from it
    engine hash ──► (sub-key 0, ..., sub-key k-1)                only for such expanded blocks

so the index holds router-granularity keys only and prompt matching is unchanged. A prompt that
leaves a cached prefix inside such an engine block matches up to ``k - 1`` sub-keys more than the
engine can reuse; :func:`align_match` rounds each pod's match down to its own block boundaries
(exactly its real reuse). A block size the router's does not divide cannot be keyed: those events
are counted (``num_block_size_mismatch``) and one warning per pod (:func:`warn_block_size_mismatch`)
names the router block size that would fix it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping

from kvmesh.core.types import Medium, PodId
from kvmesh.router.ingest_stats import IngestStats
from kvmesh.router.types import PrefixMatch

logger = logging.getLogger(__name__)

_SLOWEST_FIRST = (Medium.SHARED, Medium.DISK, Medium.CPU, Medium.GPU)


def align_match(match: PrefixMatch, block_size: int, pod_block_sizes: Mapping[PodId, int]) -> PrefixMatch:
    """Round each pod's match down to whole engine blocks of that pod (in place).

    Pods whose block size is ``block_size`` (or unknown) are untouched. Trailing blocks are taken
    from the slowest tiers first (an engine evicts a chain's tail first); a pod left with no block
    leaves the match.

    Args:
        match: a match in router blocks of ``block_size`` tokens.
        block_size: the router's tokens per block.
        pod_block_sizes: each pod's engine block size.

    Returns:
        ``match``.
    """
    dropped: list[PodId] = []
    for pod, pod_match in match.pods.items():
        per = pod_block_sizes.get(pod, block_size) // block_size
        extra = pod_match.num_blocks % per if per > 1 else 0
        if not extra:
            continue
        pod_match.num_blocks -= extra
        by_tier = pod_match.blocks_by_tier
        for tier in _SLOWEST_FIRST:
            n = by_tier.get(tier, 0)
            if n:
                take = min(n, extra)
                if take == n:
                    del by_tier[tier]
                else:
                    by_tier[tier] = n - take
                extra -= take
                if not extra:
                    break
        if not pod_match.num_blocks:
            dropped.append(pod)
    for pod in dropped:
        del match.pods[pod]
    return match


def warn_block_size_mismatch(pod: PodId, engine_bs: int, block_size: int, known_sizes: Iterable[int]) -> None:
    """Log that ``pod``'s ``engine_bs``-token blocks cannot be keyed, naming the block size that would fix it.

    Args:
        pod: the pod.
        engine_bs: its engine block size, not a multiple of ``block_size``.
        block_size: the router's tokens per block.
        known_sizes: the block sizes of every pod seen so far.
    """
    fix = math.gcd(engine_bs, *(size for size in known_sizes if size > 0))
    logger.warning(
        "pod %s publishes %d-token KV blocks, which the router's %d-token blocks do not divide: "
        "its KV events are skipped and it is routed by load only. Set the router's blockSize to "
        "%d (--block-size %d), which divides the block size of every pod seen so far",
        pod,
        engine_bs,
        block_size,
        fix,
        fix,
    )


class EngineBlockSizes:
    """How many router blocks each pod's engine blocks make, with one log line per pod and size.

    Args:
        block_size: the router's tokens per block.
        stats: where unusable sizes are counted.
        known_sizes: every pod's engine block size (named in the mismatch warning).
    """

    def __init__(
        self, block_size: int, stats: IngestStats, known_sizes: Callable[[], Mapping[PodId, int]]
    ) -> None:
        self.block_size = block_size
        self.stats = stats
        self.known_sizes = known_sizes
        self._noted: set[tuple[PodId, int, str]] = set()
        """(pod, engine block size, why) already logged: one line per pod and cause."""

    def router_blocks_per(self, pod: PodId, engine_bs: int) -> int | None:
        """Router blocks per ``engine_bs``-token engine block of ``pod``; ``None`` (counted,
        noted) when that size cannot be keyed."""
        bs = self.block_size
        if engine_bs <= 0:
            self.stats.num_bad_events += 1
            return None
        if engine_bs % bs:
            self.stats.num_block_size_mismatch += 1
            if (pod, engine_bs, "mismatch") not in self._noted:
                self._noted.add((pod, engine_bs, "mismatch"))
                warn_block_size_mismatch(pod, engine_bs, bs, self.known_sizes().values())
            return None
        per = engine_bs // bs
        if (pod, engine_bs, "size") not in self._noted:
            self._noted.add((pod, engine_bs, "size"))
            logger.info(
                "pod %s publishes %d-token KV blocks: each is indexed as %d router blocks",
                pod,
                engine_bs,
                per,
            )
        return per

    def forget(self, pod: PodId) -> None:
        """Log ``pod``'s sizes again when next seen (it left the fleet)."""
        self._noted = {note for note in self._noted if note[0] != pod}
