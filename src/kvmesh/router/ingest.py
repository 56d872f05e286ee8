# Over 450 lines: the event applier's one dispatch over every event kind and tier; its parts
# already live in plain_stores, pod_blocks, kv_groups, engine_blocks, chain_namespaces, shared_*.
"""Turns KV events into index updates.

A BlockStored event carries the engine's own block hashes and the blocks' tokens. The index is
keyed by kvmesh's chained keys, so the tokens are re-hashed here with
:class:`~kvmesh.core.hashing.BlockHasher`; the engine's hashes are kept only as opaque ids, per pod
in a :class:`~kvmesh.router.pod_blocks.PodBlocks` (engine hash ──► router key, namespace, tiers).

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

import itertools
from collections.abc import Sequence

from kvmesh.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvmesh.core.hashing import DEFAULT_BLOCK_SIZE, BlockHasher, HashAlgo, Namespace, tokens_to_bytes
from kvmesh.core.types import BlockKey, ExternalBlockHash, Medium, PodId
from kvmesh.router.chain_namespaces import ChainNamespaces
from kvmesh.router.engine_blocks import EngineBlockSizes, align_match
from kvmesh.router.event_media import event_medium
from kvmesh.router.index import ALL_MEDIA, MEDIUM_BITS, SHARED_TIER_HOLDER, BlockIndex, MediumSet
from kvmesh.router.ingest_stats import IngestStats
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.kv_groups import GroupVerdict, KVGroupSelector
from kvmesh.router.plain_stores import PlainStores
from kvmesh.router.pod_blocks import PodBlocks, Touched
from kvmesh.router.shared_refs import SharedKeyRefs
from kvmesh.router.shared_vouchers import SharedVouchers
from kvmesh.router.types import PrefixMatch

DEFAULT_MAX_BLOCKS_PER_POD = 1_000_000

_GPU_BIT = MEDIUM_BITS[Medium.GPU]

_SHARED_BIT = MEDIUM_BITS[Medium.SHARED]

_GPU_SET = MediumSet(_GPU_BIT)


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
        self._pods: dict[PodId, PodBlocks] = {}
        self._groups = KVGroupSelector(self.stats)
        self._sizes = EngineBlockSizes(block_size, self.stats, self.pod_block_sizes)
        self._namespaces = ChainNamespaces(model, revision, block_size, self.algo)
        self._shared_refs = SharedKeyRefs()
        self._vouchers = SharedVouchers()
        self._plain = PlainStores(self._namespaces, block_size, max_blocks_per_pod, memo)
        self._peer_sizes: dict[PodId, int] = {}
        """Engine block sizes of pods another router worker ingests (:mod:`~kvmesh.router.ingest_split`)."""

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
        blocks = self._pods.get(pod)
        if blocks is None or blocks.block_size is None:
            return self._peer_sizes.get(pod)
        return blocks.block_size

    def note_peer_block_size(self, pod: PodId, block_size: int) -> None:
        """``pod``'s engine block size as the router worker that ingests its events learnt it."""
        self._peer_sizes[pod] = block_size

    def pod_block_sizes(self) -> dict[PodId, int]:
        """Every pod's engine block size learnt from its events here (a copy)."""
        return {pod: blocks.block_size for pod, blocks in self._pods.items() if blocks.block_size is not None}

    def pod_kv_group(self, pod: PodId) -> int | None:
        """The KV cache group indexed for ``pod`` (``None``: untagged events or none seen yet)."""
        return self._groups.group(pod)

    def pod_stats(self) -> dict[PodId, dict[str, int | None]]:
        """Per pod: engine block size, engine blocks tracked and the KV cache group indexed."""
        return {
            pod: {
                "block_size": self.pod_block_size(pod),
                "blocks": self.num_blocks(pod),
                "kv_group": self.pod_kv_group(pod),
            }
            for pod in sorted(self._pods)
        }

    def align_match(self, match: PrefixMatch) -> PrefixMatch:
        """Round each pod's match down to whole engine blocks of that pod (in place).

        See :func:`kvmesh.router.engine_blocks.align_match`; nothing is done when no matched pod
        has blocks larger than the router's.

        Returns:
            ``match``.
        """
        bs = self.block_size
        if match.block_size != bs:
            return match
        larger = {}
        for pod in match.pods:
            blocks = self._pods.get(pod)
            size = blocks.block_size if blocks is not None else self._peer_sizes.get(pod)
            if size is not None and size > bs:
                larger[pod] = size
        return align_match(match, bs, larger) if larger else match

    def apply_batch(self, pod: PodId, batch: KVEventBatch) -> None:
        """Apply every event of one batch, in order.

        Consecutive plain BlockStored events (:class:`~kvmesh.router.plain_stores.PlainStores`) are
        keyed and tracked one by one, and their keys reach the index in one write where the run
        ends (a batch is one step of the engine; one write costs about what each event's did);
        consecutive BlockRemoved events of one tier are applied at once. The maps, the index and
        the counters end as event-by-event application leaves them.
        """
        run: list[BlockStored] = []
        gone: list[BlockRemoved] = []
        stats, admit, fits = self.stats, self._groups.admit_stored, self._plain.fits
        for event in batch.events:
            if type(event) is BlockRemoved:
                if run:
                    self._apply_run(pod, run)
                    run = []
                stats.num_events += 1
                if gone and (event.medium, event.locality) != (gone[0].medium, gone[0].locality):
                    self._removed_run(pod, gone)
                    gone = []
                if self._groups.admit_removed(pod, event.group_idx):
                    gone.append(event)
                continue
            if gone:
                self._removed_run(pod, gone)
                gone = []
            stored = event if type(event) is BlockStored and event.block_hashes else None
            if stored is not None:
                stats.num_events += 1
                verdict = admit(pod, stored)
                if verdict is GroupVerdict.INDEX and fits(stored):
                    run.append(stored)
                    continue
            if run:
                self._apply_run(pod, run)
                run = []
            if stored is None:
                self.apply(pod, event)
            else:
                self._stored_admitted(pod, stored, verdict)
        if run:
            self._apply_run(pod, run)
        if gone:
            self._removed_run(pod, gone)

    def _apply_run(self, pod: PodId, run: list[BlockStored]) -> None:
        """Apply consecutive admitted BlockStored events that fit the plain shape."""
        keys = self._plain.keys_of_run(self._pods.get(pod), run) if len(run) > 1 else None
        if keys is not None:
            self._index_run(pod, [keys] if len(set(keys)) == len(keys) else [[key] for key in keys])
            return
        done: list[list[BlockKey]] = []
        for ev in run:
            keys = self._plain.keys(self._pods.get(pod), ev)
            if keys is not None:
                done.append(keys)
                continue
            if done:
                self._index_run(pod, done)
                done = []
            self._stored_admitted(pod, ev, GroupVerdict.INDEX)
        if done:
            self._index_run(pod, done)

    def _index_run(self, pod: PodId, run: list[list[BlockKey]]) -> None:
        """Index the keys of a run of plain BlockStored events (each event's keys a list); a key
        named twice takes one write per event (it moves to the index's recent end, as it would)."""
        keys = run[0] if len(run) == 1 else list(itertools.chain.from_iterable(run))
        for part in run if len(run) > 1 and len(set(keys)) != len(keys) else [keys]:
            self.index.add(part, pod, _GPU_SET)
        self.stats.num_blocks_stored += len(keys)

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

    def publisher_restarted(self, pod: PodId) -> int:
        """``pod``'s event publisher restarted (its sequence reset): :meth:`drop_pod`, and drop the
        shared tier's blocks that only ``pod`` announced (see
        :mod:`~kvmesh.router.shared_vouchers`).

        Returns:
            Index entries dropped.
        """
        return self.drop_pod(pod) + self._withdraw_shared(pod)

    def forget_pod(self, pod: PodId) -> int:
        """:meth:`drop_pod`, and forget the pod's block size too (it left the fleet); the shared
        tier's blocks it announced stay (the store still holds them for every other pod).

        Returns:
            Index entries dropped.
        """
        dropped = self.drop_pod(pod) + self._withdraw_shared(pod, orphan=False)
        self._pods.pop(pod, None)
        self._peer_sizes.pop(pod, None)
        self._sizes.forget(pod)
        self._groups.forget(pod, notes=True)
        return dropped

    def _withdraw_shared(self, pod: PodId, *, orphan: bool = True) -> int:
        shared = self._pods.get(SHARED_TIER_HOLDER)
        if shared is None:
            self._vouchers.clear()
            return 0
        orphaned = self._vouchers.withdraw(pod, lambda h: shared.entry(h) is not None, orphan=orphan)
        if not orphaned:
            return 0
        touched = shared.remove_media(orphaned, _SHARED_BIT)
        self._index_remove(touched.keys, SHARED_TIER_HOLDER, MediumSet(_SHARED_BIT))
        self.stats.num_blocks_removed += touched.num_blocks
        return len(touched.keys)

    def _vouch_shared(self, pod: PodId, hashes: list[ExternalBlockHash]) -> None:
        vouchers = self._vouchers
        vouchers.vouch(pod, hashes)
        shared = self._pods.get(SHARED_TIER_HOLDER)
        held = 0 if shared is None else len(shared)
        if len(vouchers) > 2 * held + 4096:
            vouchers.prune(lambda h: shared is not None and shared.entry(h) is not None)

    def _drop_blocks(self, pod: PodId) -> int:
        if pod == SHARED_TIER_HOLDER:
            self._shared_refs.clear()
            self._vouchers.clear()
        blocks = self._pods.get(pod)
        # A write-behind index drops them later: count the router keys this pod was given.
        num_keys = 0 if blocks is None else blocks.num_router_keys()
        if blocks is not None:
            if blocks.block_size is None:
                del self._pods[pod]
            else:
                blocks.clear()
        dropped = self.index.clear_pod(pod)
        return num_keys if dropped is None else dropped

    def flush_namespace(self, lora: str | None = None, tenant: str | None = None) -> int:
        """Forget every block of the namespaces matching ``lora`` and ``tenant`` (``None`` = any).

        Returns:
            Engine blocks removed, summed over pods.
        """
        wanted = self._namespaces.ids_matching(lora, tenant)
        total = 0
        for pod, blocks in self._pods.items():
            keys, num_blocks = blocks.pop_namespaces(wanted)
            if num_blocks:
                self._index_remove(keys, pod)
                total += num_blocks
        return total

    def _pod_blocks(self, pod: PodId) -> PodBlocks:
        blocks = self._pods.get(pod)
        if blocks is None:
            blocks = self._pods[pod] = PodBlocks(_SHARED_BIT if pod == SHARED_TIER_HOLDER else _GPU_BIT)
        return blocks

    def _stored(self, pod: PodId, ev: BlockStored) -> None:
        if ev.block_hashes:
            # The publisher's KV cache group decides, shared-tier events included: group numbers
            # are each publisher's own, and a fleet may mix tagged (vLLM) and untagged publishers.
            self._stored_admitted(pod, ev, self._groups.admit_stored(pod, ev))

    def _stored_admitted(self, pod: PodId, ev: BlockStored, verdict: GroupVerdict) -> None:
        """Apply a BlockStored with block hashes, given its KV cache group's verdict."""
        hashes = ev.block_hashes
        origin = pod
        if verdict is GroupVerdict.SKIP:
            return
        if verdict is GroupVerdict.SWITCH:
            self._drop_blocks(origin)
        bits = MEDIUM_BITS[event_medium(ev)]
        if bits == _SHARED_BIT:
            self._vouch_shared(origin, hashes)
            if not ev.token_ids:
                self._add_shared(origin, hashes)
                return
            pod = SHARED_TIER_HOLDER
        blocks = self._pods.get(pod)
        if blocks is None:
            blocks = self._pod_blocks(pod)
        if not ev.token_ids:
            self._apply_touched(pod, blocks, blocks.add_media(hashes, bits), MediumSet(bits))
            return
        blocks.block_size = ev.block_size
        per = 1 if ev.block_size == self.block_size else self._sizes.router_blocks_per(pod, ev.block_size)
        if per is None:
            return
        raw = self._event_tokens(ev.token_ids, len(hashes) * ev.block_size)
        if raw is None:
            return
        # A shared-tier chain may continue from a block only its publisher announced.
        publisher = None if pod == origin else self._pods.get(origin)
        chain = self._chain_keys(ev, blocks, raw, publisher)
        if chain is None:
            return
        ns_id, keys = chain
        # The shared tier's holder moves a block announced again to the newest end.
        touched = blocks.store(hashes, keys, ns_id, bits, move_last=pod == SHARED_TIER_HOLDER)
        self._apply_touched(pod, blocks, touched, MediumSet(bits))

    def _event_tokens(self, tokens: list[int], need: int) -> bytes | None:
        """An event's first ``need`` token ids packed as u32 little-endian, once for the digests and
        the memo; ``None`` (counted) when too few or not u32."""
        try:
            if len(tokens) >= need:
                return tokens_to_bytes(tokens[:need] if len(tokens) > need else tokens)
        except ValueError:
            pass
        self.stats.num_bad_events += 1
        return None

    def _chain_keys(
        self,
        ev: BlockStored,
        blocks: PodBlocks,
        raw: bytes,
        publisher_blocks: PodBlocks | None = None,
    ) -> tuple[int, list[BlockKey]] | None:
        """Router keys of the router blocks of ``raw`` (packed token ids), chained from the event's
        root or from its parent's entry, as (namespace id, keys), memoized when a memo is kept;
        ``None`` (counted) when the parent is unknown. A shared-tier chain may continue from a
        block its publisher announced in its own tiers (``publisher_blocks``)."""
        if ev.parent_block_hash is None:
            hasher, ns_id = self._namespaces.hasher_of_chain(ev)
            return ns_id, self._hash(hasher, raw, None)
        link = blocks.link(ev.parent_block_hash)
        if link is None and publisher_blocks is not None:
            link = publisher_blocks.link(ev.parent_block_hash)
        if link is None:
            self.stats.num_orphans += 1
            return None
        parent, ns_id = link
        return ns_id, self._hash(self._namespaces.hasher_of(ns_id), raw, parent)

    def _hash(self, hasher: BlockHasher, raw: bytes, parent: BlockKey | None) -> list[BlockKey]:
        memo = self.memo
        if memo is None:
            return hasher.hash_packed(raw, parent)
        keys, inputs = hasher.hash_packed_with_inputs(raw, parent)
        memo.remember_inputs(inputs, keys)
        return keys

    def _removed(self, pod: PodId, ev: BlockRemoved) -> None:
        if self._groups.admit_removed(pod, ev.group_idx):
            self._removed_admitted(pod, ev, ev.block_hashes)

    def _removed_run(self, pod: PodId, run: list[BlockRemoved]) -> None:
        """Apply admitted BlockRemoved events of one tier at once (an engine announces each
        evicted block alone): one pass over the pod's map, one index write."""
        hashes = run[0].block_hashes if len(run) == 1 else [h for ev in run for h in ev.block_hashes]
        self._removed_admitted(pod, run[0], hashes)

    def _removed_admitted(self, pod: PodId, ev: BlockRemoved, hashes: list[ExternalBlockHash]) -> None:
        """Apply the removal ``ev`` announces of ``hashes``, admitted by its KV cache group."""
        medium = event_medium(ev)
        if medium is Medium.SHARED:
            pod = SHARED_TIER_HOLDER
        blocks = self._pods.get(pod)
        if blocks is None:
            self.stats.num_unknown_hashes += len(hashes)
            return
        bits = MEDIUM_BITS[medium]
        touched = blocks.remove_media(hashes, bits)
        self.stats.num_unknown_hashes += touched.num_unknown
        if touched.keys:
            self._index_remove(touched.keys, pod, MediumSet(bits))
            self.stats.num_blocks_removed += touched.num_blocks

    def _add_shared(self, pod: PodId, hashes: list[ExternalBlockHash]) -> None:
        """``pod`` wrote blocks it announced before to the shared tier (an event without tokens):
        they move to the shared tier's holder under the same engine hashes."""
        known = self._pods.get(pod)
        if known is None:
            self.stats.num_unknown_hashes += len(hashes)
            return
        shared = self._pod_blocks(SHARED_TIER_HOLDER)
        self._apply_touched(SHARED_TIER_HOLDER, shared, shared.adopt(known, hashes), MediumSet(_SHARED_BIT))

    def _apply_touched(self, pod: PodId, blocks: PodBlocks, touched: Touched, media: MediumSet) -> None:
        """Index what a BlockStored did to ``pod``'s blocks, and keep them within their bound."""
        self.stats.num_unknown_hashes += touched.num_unknown
        if not touched.keys:
            return
        if pod == SHARED_TIER_HOLDER and touched.new_keys:
            self._shared_refs.add(touched.new_keys)
        self.index.add(touched.keys, pod, media)
        self.stats.num_blocks_stored += touched.num_blocks
        excess = len(blocks) - self.max_blocks_per_pod
        if excess > 0:
            self._index_remove(blocks.pop_oldest(excess), pod)
            self.stats.num_overflow += excess

    def _index_remove(self, keys: Sequence[BlockKey], pod: PodId, media: MediumSet = ALL_MEDIA) -> None:
        """Remove ``pod``'s ``keys`` from the index; for the shared tier, only keys no remaining
        entry of its map names."""
        if pod == SHARED_TIER_HOLDER:
            keys = self._shared_refs.release(keys)
        if keys:
            self.index.remove(keys, pod, media)
