"""Turns KV events into index updates.

A BlockStored event carries the engine's own block hashes and the blocks' tokens. The index is
keyed by kvmesh's chained keys, so the tokens are re-hashed here with
:class:`~kvmesh.core.hashing.BlockHasher`; the engine's hashes are kept only as opaque ids::

    per pod:  engine hash ──► (our BlockKey, namespace id, MediumSet)
                              or our BlockKey alone: first namespace, the pod's usual tier

That map serves three purposes:

* a chain continued from ``parent_block_hash`` starts from the parent's key and namespace;
* BlockRemoved events (which carry no tokens) name our keys;
* BlockStored events for offload tiers that carry no tokens add a tier to known blocks.

Blocks in the fleet's shared tier (``medium: SHARED``, from any pod) are held by one pseudo-pod,
:data:`~kvmesh.router.index.SHARED_TIER_HOLDER`, with its own map: every endpoint can load them.

The namespace of a chain comes from its first block (:mod:`kvmesh.router.chain_namespaces`).
Each pod's map is bounded; when it overflows, the oldest blocks leave the index too, so the
router never keeps an entry it could no longer remove.

Engine blocks larger than the router's are re-hashed into router blocks
(:mod:`kvmesh.router.engine_blocks`), and of a hybrid model's KV cache groups one is indexed per
pod (:mod:`kvmesh.router.kv_groups`).

All mutation happens on one thread (the event loop that receives the events).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import repeat

import numpy as np

from kvmesh.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvmesh.core.hashing import DEFAULT_BLOCK_SIZE, BlockHasher, HashAlgo, Namespace, as_token_array
from kvmesh.core.types import BlockKey, ExternalBlockHash, Medium, PodId
from kvmesh.router.chain_namespaces import ChainNamespaces
from kvmesh.router.engine_blocks import align_match, warn_block_size_mismatch
from kvmesh.router.index import ALL_MEDIA, MEDIUM_BITS, SHARED_TIER_HOLDER, BlockIndex, MediumSet
from kvmesh.router.ingest_stats import IngestStats
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.kv_groups import GroupVerdict, KVGroupSelector
from kvmesh.router.types import PrefixMatch

logger = logging.getLogger(__name__)

DEFAULT_MAX_BLOCKS_PER_POD = 1_000_000

_Entry = tuple[BlockKey, int, int]
"""(our key, namespace id, MediumSet bits); for an expanded engine block, its last sub-key"""

_GPU_BIT = MEDIUM_BITS[Medium.GPU]

_SHARED_BIT = MEDIUM_BITS[Medium.SHARED]

_SubKeys = dict[ExternalBlockHash, tuple[BlockKey, ...]]
"""Per pod: the router keys of each engine block larger than a router block."""


class _PodBlocks(dict[ExternalBlockHash, BlockKey | _Entry]):
    """One pod's engine blocks, oldest first: engine hash ──► :data:`_Entry`.

    Nearly every block is in the first namespace (id 0) and in the pod's usual tier (the device
    tier; the shared tier for its holder), and such a block is stored as its key alone: a pod of a
    million blocks then keeps a million keys, not a million tuples besides.
    """

    __slots__ = ("usual_bits",)

    def __init__(self, usual_bits: int) -> None:
        super().__init__()
        self.usual_bits = usual_bits

    def entry(self, h: ExternalBlockHash) -> _Entry | None:
        """The entry of ``h``, if tracked."""
        value = self.get(h)
        if value is None or isinstance(value, tuple):
            return value
        return (value, 0, self.usual_bits)

    def pop_entry(self, h: ExternalBlockHash) -> _Entry | None:
        """Forget ``h``; its entry, if it was tracked."""
        value = self.pop(h, None)
        if value is None or isinstance(value, tuple):
            return value
        return (value, 0, self.usual_bits)

    def put(self, h: ExternalBlockHash, key: BlockKey, ns_id: int, bits: int) -> None:
        """Track ``h`` (at the end if new)."""
        self[h] = key if ns_id == 0 and bits == self.usual_bits else (key, ns_id, bits)

    def put_new(
        self, hashes: Sequence[ExternalBlockHash], keys: Sequence[BlockKey], ns_id: int, bits: int
    ) -> None:
        """Track ``hashes`` (none tracked yet) at C speed."""
        if ns_id == 0 and bits == self.usual_bits:
            self.update(zip(hashes, keys, strict=True))
        else:
            self.update(zip(hashes, zip(keys, repeat(ns_id), repeat(bits), strict=False), strict=True))


def event_medium(ev: BlockStored | BlockRemoved) -> Medium:
    """The tier an event speaks of: a remote tier behind vLLM's native offloading (locality
    ``REMOTE``, such as kvmesh's secondary tier) is reachable from every pod, so it counts as SHARED."""
    if ev.locality is not None and ev.locality.upper() == "REMOTE":
        return Medium.SHARED
    return Medium.parse(ev.medium)


def _key_of(value: BlockKey | _Entry) -> BlockKey:
    return value[0] if isinstance(value, tuple) else value


class EventApplier:
    """Applies KV event batches from many pods to one :class:`BlockIndex`.

    Args:
        index: where the blocks go.
        model: the model name used in every namespace (must equal the engines' namespace model).
        block_size: the router's tokens per block. Events whose block size is a multiple of it are
            re-hashed into router blocks; other sizes are counted and skipped.
        algo: the engines' key digest.
        revision: model revision in the namespace.
        max_blocks_per_pod: bound on each pod's engine-hash map (engine blocks).
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
        self._pods: dict[PodId, _PodBlocks] = {}
        self._sub_keys: dict[PodId, _SubKeys] = {}
        """Only pods with engine blocks larger than the router's have an entry."""
        self._block_sizes: dict[PodId, int] = {}
        self._groups = KVGroupSelector(self.stats)
        self._noted: set[tuple[PodId, int, str]] = set()
        """(pod, engine block size, why) already logged: one line per pod and cause."""
        self._namespaces = ChainNamespaces(model, revision, block_size, self.algo)
        self._shared_keys: set[BlockKey] = set()
        """Router keys some entry of the shared tier's map names. Publishers whose engine hashes
        differ (vLLM pods seeded apart, a mixed fleet) each add one entry for the same block, and
        the index entry goes only when the last one does."""
        self._shared_extra: dict[BlockKey, int] = {}
        """Per router key named by more than one entry of the shared tier's map: the entries beyond
        the first (a set and this rare map instead of a count per key: a third of the memory)."""

    def namespace(self, lora: str = "", tenant: str = "") -> Namespace:
        """The namespace requests with this LoRA and tenant hash into."""
        return self._namespaces.namespace(lora, tenant)

    def hasher(self, lora: str = "", tenant: str = "") -> BlockHasher:
        """The (cached) block hasher of one namespace."""
        return self._namespaces.hasher(lora, tenant)[0]

    def num_blocks(self, pod: PodId) -> int:
        """Engine blocks the applier currently tracks for ``pod``."""
        return len(self._pods.get(pod, ()))

    def pod_block_size(self, pod: PodId) -> int | None:
        """Tokens per block of ``pod``'s engine, from its latest BlockStored with tokens."""
        return self._block_sizes.get(pod)

    def pod_block_sizes(self) -> dict[PodId, int]:
        """Every pod's learned engine block size (a copy)."""
        return dict(self._block_sizes)

    def pod_kv_group(self, pod: PodId) -> int | None:
        """The KV cache group indexed for ``pod`` (``None``: untagged events or none seen yet)."""
        return self._groups.group(pod)

    def pod_stats(self) -> dict[PodId, dict[str, int | None]]:
        """Per pod: engine block size, engine blocks tracked and the KV cache group indexed."""
        return {
            pod: {
                "block_size": self._block_sizes.get(pod),
                "blocks": self.num_blocks(pod),
                "kv_group": self.pod_kv_group(pod),
            }
            for pod in sorted(self._pods.keys() | self._block_sizes.keys())
        }

    def align_match(self, match: PrefixMatch) -> PrefixMatch:
        """Round each pod's match down to whole engine blocks of that pod (in place).

        See :func:`kvmesh.router.engine_blocks.align_match`; nothing is done when no pod has
        blocks larger than the router's.

        Returns:
            ``match``.
        """
        if not self._sub_keys or match.block_size != self.block_size:
            return match
        return align_match(match, self.block_size, self._block_sizes)

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

        The pod's block size stays known (see :meth:`forget_pod`); its KV cache group is learned
        again from its next events.

        Returns:
            Index entries dropped.
        """
        self.stats.num_clears += 1
        self._groups.forget(pod)
        return self._drop_blocks(pod)

    def forget_pod(self, pod: PodId) -> int:
        """:meth:`drop_pod`, and forget the pod's block size too (it left the fleet).

        Returns:
            Index entries dropped.
        """
        dropped = self.drop_pod(pod)
        self._block_sizes.pop(pod, None)
        self._noted = {note for note in self._noted if note[0] != pod}
        self._groups.forget(pod, notes=True)
        return dropped

    def _drop_blocks(self, pod: PodId) -> int:
        if pod == SHARED_TIER_HOLDER:
            self._shared_keys.clear()
            self._shared_extra.clear()
        blocks = self._pods.pop(pod, None)
        sub = self._sub_keys.pop(pod, None)
        dropped = self.index.clear_pod(pod)
        if dropped is not None:
            return dropped
        # A write-behind index drops them later: count the router keys this pod was given.
        if not blocks:
            return 0
        return len(blocks) + sum(len(keys) - 1 for keys in (sub or {}).values())

    def flush_namespace(self, lora: str | None = None, tenant: str | None = None) -> int:
        """Forget every block of the namespaces matching ``lora`` and ``tenant`` (``None`` = any).

        Returns:
            Engine blocks removed, summed over pods.
        """
        wanted = self._namespaces.ids_matching(lora, tenant)
        total = 0
        for pod, blocks in self._pods.items():
            gone = [h for h, v in blocks.items() if (v[1] if isinstance(v, tuple) else 0) in wanted]
            if gone:
                self._index_remove(self._pop_keys(pod, blocks, gone), pod)
                total += len(gone)
        return total

    def _pop_keys(
        self, pod: PodId, blocks: _PodBlocks, hashes: Sequence[ExternalBlockHash]
    ) -> list[BlockKey]:
        """Forget tracked ``hashes`` of ``pod``; their router keys, every sub-key included."""
        sub = self._sub_keys.get(pod)
        if sub is None:
            return [_key_of(blocks.pop(h)) for h in hashes]
        keys: list[BlockKey] = []
        for h in hashes:
            key = _key_of(blocks.pop(h))
            expanded = sub.pop(h, None)
            if expanded is None:
                keys.append(key)
            else:
                keys.extend(expanded)
        return keys

    def _stored(self, pod: PodId, ev: BlockStored) -> None:
        hashes = ev.block_hashes
        n = len(hashes)
        if n == 0:
            return
        # The publisher's KV cache group decides, shared-tier events included: group numbers are
        # each publisher's own, and a fleet may mix tagged (vLLM) and untagged publishers.
        origin = pod
        verdict = self._groups.admit_stored(origin, ev)
        if verdict is GroupVerdict.SKIP:
            return
        if verdict is GroupVerdict.SWITCH:
            self._drop_blocks(origin)
        bits = MEDIUM_BITS[event_medium(ev)]
        if bits == _SHARED_BIT:
            if not ev.token_ids:
                self._add_shared(origin, hashes)
                return
            pod = SHARED_TIER_HOLDER
        blocks = self._pods.get(pod)
        if blocks is None:
            blocks = self._pods[pod] = _PodBlocks(_SHARED_BIT if pod == SHARED_TIER_HOLDER else _GPU_BIT)
        # A shared-tier chain may continue from a block only its publisher announced.
        publisher = None if pod == origin else self._pods.get(origin)
        tokens = ev.token_ids
        if not tokens:
            self._add_tier(pod, blocks, hashes, bits)
            return
        bs = self.block_size
        engine_bs = ev.block_size
        self._block_sizes[pod] = engine_bs
        if engine_bs != bs:
            self._stored_resized(pod, ev, blocks, bits, publisher)
            return
        token_array = self._event_tokens(tokens, n * bs)
        if token_array is None:
            return
        chain = self._chain_keys(ev, blocks, token_array, n, publisher)
        if chain is None:
            return
        parent_key, ns_id, keys = chain
        if self.memo is not None:
            self.memo.remember(parent_key, token_array[: n * bs].tobytes(), keys)
        shared = pod == SHARED_TIER_HOLDER
        if blocks.keys().isdisjoint(hashes):
            # The common case (new blocks): build every entry at C speed.
            blocks.put_new(hashes, keys, ns_id, bits)
            if shared:
                self._shared_added(keys)
        else:
            get = blocks.entry
            for h, key in zip(hashes, keys, strict=True):
                old = blocks.pop_entry(h) if shared else get(h)  # shared: re-announced blocks move last
                blocks.put(h, key, ns_id, bits if old is None else old[2] | bits)
                if shared and old is None:
                    self._shared_added((key,))
            sub = self._sub_keys.get(pod)
            if sub:
                for h in hashes:
                    sub.pop(h, None)
        self.index.add(keys, pod, MediumSet(bits))
        self.stats.num_blocks_stored += n
        if len(blocks) > self.max_blocks_per_pod:
            self._overflow(pod, blocks)

    def _event_tokens(self, tokens: list[int], need: int) -> np.ndarray | None:
        """An event's first ``need`` token ids as u32; ``None`` (counted) when too few or not u32."""
        try:
            if len(tokens) >= need:
                return as_token_array(tokens[:need] if len(tokens) > need else tokens)
        except ValueError:
            pass
        self.stats.num_bad_events += 1
        return None

    def _chain_keys(
        self,
        ev: BlockStored,
        blocks: _PodBlocks,
        token_array: np.ndarray,
        num_keys: int,
        publisher_blocks: _PodBlocks | None = None,
    ) -> tuple[BlockKey, int, list[BlockKey]] | None:
        """Router keys of ``num_keys`` router blocks of ``token_array``, chained from the event's
        root or from its parent's entry, as (parent key, namespace id, keys); ``None`` (counted) when
        the parent is unknown. A shared-tier chain may continue from a block its publisher announced
        in its own tiers (``publisher_blocks``)."""
        if ev.parent_block_hash is None:
            hasher, ns_id = self._namespaces.hasher_of_chain(ev)
            return hasher.root, ns_id, hasher.hash_blocks(token_array, None, num_keys)
        parent = blocks.entry(ev.parent_block_hash)
        if parent is None and publisher_blocks is not None:
            parent = publisher_blocks.entry(ev.parent_block_hash)
        if parent is None:
            self.stats.num_orphans += 1
            return None
        ns_id = parent[1]
        hasher = self._namespaces.hasher_of(ns_id)
        return parent[0], ns_id, hasher.hash_blocks(token_array, parent[0], num_keys)

    def _stored_resized(
        self,
        pod: PodId,
        ev: BlockStored,
        blocks: _PodBlocks,
        bits: int,
        publisher_blocks: _PodBlocks | None,
    ) -> None:
        """A BlockStored whose engine block size differs from the router's."""
        bs = self.block_size
        engine_bs = ev.block_size
        if engine_bs <= 0:
            self.stats.num_bad_events += 1
            return
        if engine_bs % bs:
            self.stats.num_block_size_mismatch += 1
            if (pod, engine_bs, "mismatch") not in self._noted:
                self._noted.add((pod, engine_bs, "mismatch"))
                warn_block_size_mismatch(pod, engine_bs, bs, self._block_sizes.values())
            return
        hashes = ev.block_hashes
        n = len(hashes)
        per = engine_bs // bs
        tokens = ev.token_ids
        token_array = self._event_tokens(tokens, n * engine_bs)
        if token_array is None:
            return
        if (pod, engine_bs, "size") not in self._noted:
            self._noted.add((pod, engine_bs, "size"))
            logger.info(
                "pod %s publishes %d-token KV blocks: each is indexed as %d router blocks",
                pod,
                engine_bs,
                per,
            )
        # An expanded parent's entry holds its last sub-key: the chain value after its tokens.
        chain = self._chain_keys(ev, blocks, token_array, n * per, publisher_blocks)
        if chain is None:
            return
        parent_key, ns_id, keys = chain
        if self.memo is not None:
            # Router-block granularity: n * per keys over the same n * engine_bs tokens.
            self.memo.remember(parent_key, token_array.tobytes(), keys)
        sub = self._sub_keys.get(pod)
        if sub is None:
            sub = self._sub_keys[pod] = {}
        get = blocks.entry
        shared = pod == SHARED_TIER_HOLDER
        for i, h in enumerate(hashes):
            expanded = tuple(keys[i * per : (i + 1) * per])
            old = blocks.pop_entry(h) if shared else get(h)
            blocks.put(h, expanded[-1], ns_id, bits if old is None else old[2] | bits)
            sub[h] = expanded
            if shared and old is None:
                self._shared_added(expanded)
        self.index.add(keys, pod, MediumSet(bits))
        self.stats.num_blocks_stored += n
        if len(blocks) > self.max_blocks_per_pod:
            self._overflow(pod, blocks)

    def _add_tier(
        self,
        pod: PodId,
        blocks: _PodBlocks,
        hashes: Sequence[ExternalBlockHash],
        bits: int,
    ) -> None:
        sub = self._sub_keys.get(pod)
        keys: list[BlockKey] = []
        num_added = 0
        for h in hashes:
            entry = blocks.entry(h)
            if entry is None:
                self.stats.num_unknown_hashes += 1
                continue
            blocks.put(h, entry[0], entry[1], entry[2] | bits)
            expanded = None if sub is None else sub.get(h)
            if expanded is None:
                keys.append(entry[0])
            else:
                keys.extend(expanded)
            num_added += 1
        if keys:
            self.index.add(keys, pod, MediumSet(bits))
            self.stats.num_blocks_stored += num_added

    def _removed(self, pod: PodId, ev: BlockRemoved) -> None:
        if not self._groups.admit_removed(pod, ev.group_idx):
            return
        if event_medium(ev) is Medium.SHARED:
            pod = SHARED_TIER_HOLDER
        blocks = self._pods.get(pod)
        if blocks is None:
            self.stats.num_unknown_hashes += len(ev.block_hashes)
            return
        bits = MEDIUM_BITS[event_medium(ev)]
        sub = self._sub_keys.get(pod)
        keys: list[BlockKey] = []
        num_removed = 0
        for h in ev.block_hashes:
            entry = blocks.entry(h)
            if entry is None:
                self.stats.num_unknown_hashes += 1
                continue
            left = entry[2] & ~bits
            if left:
                blocks.put(h, entry[0], entry[1], left)
                expanded = None if sub is None else sub.get(h)
            else:
                del blocks[h]
                expanded = None if sub is None else sub.pop(h, None)
            if expanded is None:
                keys.append(entry[0])
            else:
                keys.extend(expanded)
            num_removed += 1
        if keys:
            self._index_remove(keys, pod, MediumSet(bits))
            self.stats.num_blocks_removed += num_removed

    def _add_shared(self, pod: PodId, hashes: Sequence[ExternalBlockHash]) -> None:
        """``pod`` wrote blocks it announced before to the shared tier (an event without tokens):
        they move to the shared tier's holder under the same engine hashes."""
        known = self._pods.get(pod)
        if known is None:
            self.stats.num_unknown_hashes += len(hashes)
            return
        shared = self._pods.get(SHARED_TIER_HOLDER)
        if shared is None:
            shared = self._pods[SHARED_TIER_HOLDER] = _PodBlocks(_SHARED_BIT)
        sub = self._sub_keys.get(pod)
        keys: list[BlockKey] = []
        num_added = 0
        for h in hashes:
            entry = known.entry(h)
            if entry is None:
                self.stats.num_unknown_hashes += 1
                continue
            new = shared.pop(h, None) is None  # a re-announced block moves last
            shared.put(h, entry[0], entry[1], _SHARED_BIT)
            expanded = None if sub is None else sub.get(h)
            if expanded is None:
                keys.append(entry[0])
            else:
                self._sub_keys.setdefault(SHARED_TIER_HOLDER, {})[h] = expanded
                keys.extend(expanded)
            if new:
                self._shared_added(keys[-1:] if expanded is None else expanded)
            num_added += 1
        if keys:
            self.index.add(keys, SHARED_TIER_HOLDER, MediumSet(_SHARED_BIT))
            self.stats.num_blocks_stored += num_added
            if len(shared) > self.max_blocks_per_pod:
                self._overflow(SHARED_TIER_HOLDER, shared)

    def _shared_added(self, keys: Sequence[BlockKey]) -> None:
        named = self._shared_keys
        if named.isdisjoint(keys):
            named.update(keys)
            return
        extra = self._shared_extra
        for key in keys:
            if key in named:
                extra[key] = extra.get(key, 0) + 1
            else:
                named.add(key)

    def _index_remove(self, keys: list[BlockKey], pod: PodId, media: MediumSet = ALL_MEDIA) -> None:
        """Remove ``pod``'s ``keys`` from the index; for the shared tier, only keys no remaining
        entry of its map names."""
        if pod == SHARED_TIER_HOLDER:
            named, extra = self._shared_keys, self._shared_extra
            if not extra:
                named.difference_update(keys)
            else:
                last: list[BlockKey] = []
                for key in keys:
                    n = extra.get(key, 0)
                    if n > 1:
                        extra[key] = n - 1
                    elif n:
                        del extra[key]
                    else:
                        named.discard(key)
                        last.append(key)
                keys = last
        if keys:
            self.index.remove(keys, pod, media)

    def _overflow(self, pod: PodId, blocks: _PodBlocks) -> None:
        excess = len(blocks) - self.max_blocks_per_pod
        oldest = []
        for h in blocks:
            oldest.append(h)
            if len(oldest) >= excess:
                break
        self._index_remove(self._pop_keys(pod, blocks, oldest), pod)
        self.stats.num_overflow += len(oldest)
