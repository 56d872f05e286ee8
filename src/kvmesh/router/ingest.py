"""Turns KV events into index updates.

A BlockStored event carries the engine's own block hashes and the blocks' tokens. The index is
keyed by kvmesh's chained keys, so the tokens are re-hashed here with
:class:`~kvmesh.core.hashing.BlockHasher`; the engine's hashes are kept only as opaque ids::

    per pod:  engine hash ──► (our BlockKey, namespace id, MediumSet)

That map serves three purposes:

* a chain continued from ``parent_block_hash`` starts from the parent's key and namespace;
* BlockRemoved events (which carry no tokens) name our keys;
* BlockStored events for offload tiers that carry no tokens add a tier to known blocks.

The namespace of a chain comes from its first block: model (fixed per applier), ``lora_name`` and
the tenant salt found in ``extra_keys`` of block 0 (vLLM's ``cache_salt`` travels the same way).
Each pod's map is bounded; when it overflows, the oldest blocks leave the index too, so the
router never keeps an entry it could no longer remove.

All mutation happens on one thread (the event loop that receives the events).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from kvmesh.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvmesh.core.hashing import DEFAULT_BLOCK_SIZE, BlockHasher, HashAlgo, Namespace
from kvmesh.core.types import BlockKey, ExternalBlockHash, Medium, PodId
from kvmesh.router.index import MEDIUM_BITS, BlockIndex, MediumSet
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.prefix import as_token_array

DEFAULT_MAX_BLOCKS_PER_POD = 1_000_000

_Entry = tuple[BlockKey, int, int]
"""(our key, namespace id, MediumSet bits)"""


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
        num_bad_events: events that could not be used (block size mismatch, short token list).
        num_overflow: blocks pushed out because a pod's map was full.
    """

    num_events: int = 0
    num_blocks_stored: int = 0
    num_blocks_removed: int = 0
    num_clears: int = 0
    num_orphans: int = 0
    num_unknown_hashes: int = 0
    num_bad_events: int = 0
    num_overflow: int = 0


class EventApplier:
    """Applies KV event batches from many pods to one :class:`BlockIndex`.

    Args:
        index: where the blocks go.
        model: the model name used in every namespace (must equal the engines' namespace model).
        block_size: tokens per block; events with another block size are counted and skipped.
        algo: the engines' key digest.
        revision: model revision in the namespace.
        max_blocks_per_pod: bound on each pod's engine-hash map.
        memo: where to keep the keys computed from event tokens, so request matching can skip
            re-hashing them (``None``: nothing kept).
    """

    def __init__(
        self,
        index: BlockIndex,
        *,
        model: str,
        block_size: int = DEFAULT_BLOCK_SIZE,
        algo: HashAlgo = HashAlgo.SHA256,
        revision: str = "",
        max_blocks_per_pod: int = DEFAULT_MAX_BLOCKS_PER_POD,
        memo: BlockKeyMemo | None = None,
    ) -> None:
        if max_blocks_per_pod <= 0:
            raise ValueError(f"max_blocks_per_pod must be positive, got {max_blocks_per_pod}")
        self.index = index
        self.model = model
        self.revision = revision
        self.block_size = block_size
        self.algo = HashAlgo(algo)
        self.max_blocks_per_pod = max_blocks_per_pod
        self.memo = memo
        self.stats = IngestStats()
        self._pods: dict[PodId, dict[ExternalBlockHash, _Entry]] = {}
        self._namespaces: list[Namespace] = []
        self._hashers: dict[tuple[str, str], tuple[BlockHasher, int]] = {}

    def namespace(self, lora: str = "", tenant: str = "") -> Namespace:
        """The namespace requests with this LoRA and tenant hash into."""
        return Namespace(self.model, self.revision, lora, tenant)

    def hasher(self, lora: str = "", tenant: str = "") -> BlockHasher:
        """The (cached) block hasher of one namespace."""
        return self._hasher_entry(lora, tenant)[0]

    def _hasher_entry(self, lora: str, tenant: str) -> tuple[BlockHasher, int]:
        entry = self._hashers.get((lora, tenant))
        if entry is None:
            ns = self.namespace(lora, tenant)
            entry = (BlockHasher(ns, self.block_size, self.algo), len(self._namespaces))
            self._namespaces.append(ns)
            self._hashers[(lora, tenant)] = entry
        return entry

    def num_blocks(self, pod: PodId) -> int:
        """Blocks the applier currently tracks for ``pod``."""
        return len(self._pods.get(pod, ()))

    def apply_batch(self, pod: PodId, batch: KVEventBatch) -> None:
        """Apply every event of one batch, in order."""
        for event in batch.events:
            self.apply(pod, event)

    def apply(self, pod: PodId, event: KVEvent) -> None:
        """Apply one event from ``pod``."""
        self.stats.num_events += 1
        match event:
            case BlockStored():
                self._stored(pod, event)
            case BlockRemoved():
                self._removed(pod, event)
            case AllBlocksCleared():
                self.drop_pod(pod)

    def drop_pod(self, pod: PodId) -> int:
        """Forget every block of ``pod`` (cache cleared, publisher restarted, endpoint removed).

        Returns:
            Index entries dropped.
        """
        self.stats.num_clears += 1
        self._pods.pop(pod, None)
        return self.index.clear_pod(pod)

    def flush_namespace(self, lora: str | None = None, tenant: str | None = None) -> int:
        """Forget every block of the namespaces matching ``lora`` and ``tenant`` (``None`` = any).

        Returns:
            Blocks removed, summed over pods.
        """
        wanted = {
            i
            for i, ns in enumerate(self._namespaces)
            if (lora is None or ns.lora == lora) and (tenant is None or ns.tenant == tenant)
        }
        total = 0
        for pod, blocks in self._pods.items():
            gone = [h for h, (_, ns_id, _) in blocks.items() if ns_id in wanted]
            keys = [blocks.pop(h)[0] for h in gone]
            if keys:
                self.index.remove(keys, pod)
                total += len(keys)
        return total

    def _stored(self, pod: PodId, ev: BlockStored) -> None:
        hashes = ev.block_hashes
        n = len(hashes)
        if n == 0:
            return
        bits = MEDIUM_BITS[Medium.parse(ev.medium)]
        blocks = self._pods.get(pod)
        if blocks is None:
            blocks = self._pods[pod] = {}
        tokens = ev.token_ids
        if not tokens:
            self._add_tier(pod, blocks, hashes, bits)
            return
        bs = self.block_size
        if ev.block_size != bs or len(tokens) < n * bs:
            self.stats.num_bad_events += 1
            return
        try:
            token_array = as_token_array(tokens[: n * bs] if len(tokens) > n * bs else tokens)
        except ValueError:
            self.stats.num_bad_events += 1
            return
        if ev.parent_block_hash is None:
            hasher, ns_id = self._hasher_entry(*self._chain_namespace(ev))
            parent_key = hasher.root
            keys = hasher.hash_blocks(token_array, None, n)
        else:
            parent = blocks.get(ev.parent_block_hash)
            if parent is None:
                self.stats.num_orphans += 1
                return
            ns_id = parent[1]
            ns = self._namespaces[ns_id]
            hasher = self._hasher_entry(ns.lora, ns.tenant)[0]
            parent_key = parent[0]
            keys = hasher.hash_blocks(token_array, parent_key, n)
        if self.memo is not None:
            self.memo.remember(parent_key, token_array[: n * bs].tobytes(), keys)
        if blocks.keys().isdisjoint(hashes):
            # The common case (new blocks): build every entry at C speed.
            blocks.update(zip(hashes, zip(keys, repeat(ns_id), repeat(bits), strict=False), strict=True))
        else:
            get = blocks.get
            for h, key in zip(hashes, keys, strict=True):
                old = get(h)
                blocks[h] = (key, ns_id, bits if old is None else old[2] | bits)
        self.index.add(keys, pod, MediumSet(bits))
        self.stats.num_blocks_stored += n
        if len(blocks) > self.max_blocks_per_pod:
            self._overflow(pod, blocks)

    def _add_tier(
        self,
        pod: PodId,
        blocks: dict[ExternalBlockHash, _Entry],
        hashes: Sequence[ExternalBlockHash],
        bits: int,
    ) -> None:
        keys: list[BlockKey] = []
        for h in hashes:
            entry = blocks.get(h)
            if entry is None:
                self.stats.num_unknown_hashes += 1
                continue
            blocks[h] = (entry[0], entry[1], entry[2] | bits)
            keys.append(entry[0])
        if keys:
            self.index.add(keys, pod, MediumSet(bits))
            self.stats.num_blocks_stored += len(keys)

    def _removed(self, pod: PodId, ev: BlockRemoved) -> None:
        blocks = self._pods.get(pod)
        if blocks is None:
            self.stats.num_unknown_hashes += len(ev.block_hashes)
            return
        bits = MEDIUM_BITS[Medium.parse(ev.medium)]
        keys: list[BlockKey] = []
        for h in ev.block_hashes:
            entry = blocks.get(h)
            if entry is None:
                self.stats.num_unknown_hashes += 1
                continue
            left = entry[2] & ~bits
            if left:
                blocks[h] = (entry[0], entry[1], left)
            else:
                del blocks[h]
            keys.append(entry[0])
        if keys:
            self.index.remove(keys, pod, MediumSet(bits))
            self.stats.num_blocks_removed += len(keys)

    def _overflow(self, pod: PodId, blocks: dict[ExternalBlockHash, _Entry]) -> None:
        excess = len(blocks) - self.max_blocks_per_pod
        oldest = []
        for h in blocks:
            oldest.append(h)
            if len(oldest) >= excess:
                break
        keys = [blocks.pop(h)[0] for h in oldest]
        self.index.remove(keys, pod)
        self.stats.num_overflow += len(keys)

    @staticmethod
    def _namespace_fields(lora_name: str | None, extra_keys: list[Any] | None) -> tuple[str, str]:
        lora = lora_name or ""
        first: Any = extra_keys
        if extra_keys and (extra_keys[0] is None or isinstance(extra_keys[0], list | tuple)):
            # One entry per block (vLLM's newer form): the tenant salt sits in block 0's keys.
            first = extra_keys[0]
        tenant = ""
        for item in first or ():
            if isinstance(item, str) and item != lora:
                tenant = item
        return lora, tenant

    def _chain_namespace(self, ev: BlockStored) -> tuple[str, str]:
        return self._namespace_fields(ev.lora_name, ev.extra_keys)
