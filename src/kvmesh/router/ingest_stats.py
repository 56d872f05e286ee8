"""What the router's event applier has counted: :class:`IngestStats`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class IngestStats:
    """Counters of what the applier has seen.

    Attributes:
        num_events: events applied.
        num_blocks_stored: blocks added (one per engine hash of a BlockStored).
        num_blocks_removed: blocks removed from some tier.
        num_clears: AllBlocksCleared events and pod drops.
        num_orphans: BlockStored chains whose parent hash was unknown (skipped).
        num_unknown_hashes: removed or token-less stored hashes never seen stored.
        num_bad_events: malformed BlockStored events (short token list, token ids not u32,
            block size not positive), skipped.
        num_overflow: blocks pushed out because a pod's map was full.
        num_block_size_mismatch: BlockStored events whose block size is not a multiple of the
            router's, skipped (the pod is routed by load only; a warning names the fix).
        num_skipped_groups: BlockStored and BlockRemoved events of KV cache groups not indexed
            (sliding window, Mamba, ... or a second full-attention group), skipped.
    """

    num_events: int = 0
    num_blocks_stored: int = 0
    num_blocks_removed: int = 0
    num_clears: int = 0
    num_orphans: int = 0
    num_unknown_hashes: int = 0
    num_bad_events: int = 0
    num_overflow: int = 0
    num_block_size_mismatch: int = 0
    num_skipped_groups: int = 0
