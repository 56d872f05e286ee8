"""The common BlockStored, keyed and tracked without the event applier's general path.

Nearly every event an engine publishes stores new blocks of the router's size in its device tier,
continuing a chain of the first namespace or starting one: a request's prefill blocks at once, then
one block each ``block_size`` tokens while it decodes. Most events therefore carry a block or two,
so what an event costs apart from its blocks (checks, calls, one index write) decides the rate.
:class:`PlainStores` keys and tracks such an event in a handful of checks; the applier writes the
keys of a batch's consecutive plain events to the index at once
(:meth:`~kvmesh.router.ingest.EventApplier.apply_batch`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvmesh.core.events import BlockStored
from kvmesh.core.hashing import tokens_to_bytes
from kvmesh.core.types import BlockKey, Medium
from kvmesh.router.chain_namespaces import ChainNamespaces
from kvmesh.router.event_media import event_medium
from kvmesh.router.index import MEDIUM_BITS
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.pod_blocks import PodBlocks

_GPU_BIT = MEDIUM_BITS[Medium.GPU]

_GPU_MEDIA = (None, "GPU")
"""``medium`` of device-tier events as engines write it (any other goes through ``event_medium``)."""


class PlainStores:
    """Keys plain BlockStored events into a pod's blocks.

    Args:
        namespaces: the applier's chain namespaces.
        block_size: the router's tokens per block.
        max_blocks_per_pod: the bound on each pod's blocks.
        memo: the applier's key memo (``None``: none kept).
    """

    def __init__(
        self,
        namespaces: ChainNamespaces,
        block_size: int,
        max_blocks_per_pod: int,
        memo: BlockKeyMemo | None,
    ) -> None:
        self._namespaces = namespaces
        self._block_size = block_size
        self._bound = max_blocks_per_pod
        self._memo = memo

    def fits(self, ev: BlockStored) -> bool:
        """Whether ``ev`` has the shape of a plain event: blocks of the router's size with all
        their tokens, in the device tier (:meth:`keys` checks the rest)."""
        return (
            ev.block_size == self._block_size
            and len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
            and ((ev.locality is None and ev.medium in _GPU_MEDIA) or event_medium(ev) is Medium.GPU)
        )

    def keys_of_run(self, blocks: PodBlocks | None, run: Sequence[BlockStored]) -> list[BlockKey] | None:
        """:meth:`keys` of a run of events that :meth:`fits`, at once, when each announces one
        new block continuing a tracked chain of the first namespace (requests decoding) and no
        memo is kept: links, tokens and digests of the whole run in a few passes.

        Returns:
            The run's keys, one per event in order; ``None``, nothing changed, when the run is
            not such a run (then each event goes through :meth:`keys`).
        """
        if blocks is None or self._memo is not None or blocks.usual_bits != _GPU_BIT:
            return None
        hashes = list(itertools.chain.from_iterable([ev.block_hashes for ev in run]))
        if len(hashes) != len(run) or len(set(hashes)) != len(hashes):
            return None
        # A parent announced earlier in the run is not tracked yet: such a run goes event by event.
        parents = blocks.plain_keys_of([ev.parent_block_hash for ev in run])
        if parents is None:
            return None
        try:
            raw = tokens_to_bytes(list(itertools.chain.from_iterable([ev.token_ids for ev in run])))
        except ValueError:
            return None
        keys = self._namespaces.hasher_of(0).hash_each(raw, parents)
        if not blocks.track_new(hashes, keys, self._bound):
            return None
        blocks.block_size = self._block_size
        return keys

    def keys(self, blocks: PodBlocks | None, ev: BlockStored) -> list[BlockKey] | None:
        """Key ``ev`` and track its blocks in ``blocks``, if it is plain: new blocks of the
        router's size with all their tokens, in the device tier of a pod already known, starting a
        chain or continuing one of the first namespace, within the pod's bound.

        The caller has admitted ``ev`` by its KV cache group and still writes the keys to the
        index and counts the blocks.

        Returns:
            The blocks' router keys; ``None``, nothing changed, for an event that is not plain
            (the general path applies it, and counts what is wrong with it).
        """
        hashes = ev.block_hashes
        tokens = ev.token_ids
        if blocks is None or blocks.usual_bits != _GPU_BIT or not self.fits(ev):
            return None
        parent: BlockKey | None = None
        if ev.parent_block_hash is None:
            hasher, ns_id = self._namespaces.hasher_of_chain(ev)
        else:
            link = blocks.link(ev.parent_block_hash)
            if link is None:
                return None
            parent, ns_id = link
            hasher = self._namespaces.hasher_of(ns_id)
        if ns_id:
            return None
        try:
            raw = tokens_to_bytes(tokens)
        except ValueError:
            return None
        memo = self._memo
        if memo is None:
            keys = hasher.hash_packed(raw, parent)
            if not blocks.track_new(hashes, keys, self._bound):
                return None
        else:
            keys, inputs = hasher.hash_packed_with_inputs(raw, parent)
            if not blocks.track_new(hashes, keys, self._bound):
                return None
            memo.remember_inputs(inputs, keys)
        blocks.block_size = ev.block_size
        return keys
