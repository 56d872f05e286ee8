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

Engine block size. Each pod's block size is learned from its BlockStored events
(:meth:`EventApplier.pod_block_size`). A pod whose blocks are ``k`` times the router's (vLLM on CPU
uses 128 tokens, the router 16) has each engine block re-hashed into ``k`` router blocks::

    engine hash ──► (last sub-key, namespace id, MediumSet)     as above: chains continue from it
    engine hash ──► (sub-key 0, ..., sub-key k-1)                only for such expanded blocks

so the index holds router-granularity keys only and prompt matching is unchanged. A prompt that
leaves a cached prefix inside such an engine block matches up to ``k - 1`` sub-keys more than the
engine can reuse; :meth:`EventApplier.align_match` rounds each pod's match down to its own block
boundaries (exactly its real reuse). A block size the router's does not divide cannot be keyed:
those events are counted (``num_block_size_mismatch``) and one warning per pod names the router
block size that would fix it.

KV cache groups. vLLM announces the same tokens once per KV cache group (hybrid models: sliding
window, Mamba, full attention, ...) and tags events with ``group_idx`` and, from 0.32,
``kv_cache_spec_kind``. Only full-prefix kinds (full attention, MLA, sink full attention; untagged
events count as full attention) describe a reusable prefix, and one such group is enough: each pod
indexes its lowest full-attention group and skips the others (``num_skipped_groups``), removals
included, so the engine-hash map never mixes groups (whose hashes are equal for equal tokens).

All mutation happens on one thread (the event loop that receives the events).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np

from kvmesh.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvmesh.core.hashing import DEFAULT_BLOCK_SIZE, BlockHasher, HashAlgo, Namespace
from kvmesh.core.types import BlockKey, ExternalBlockHash, Medium, PodId
from kvmesh.router.index import MEDIUM_BITS, BlockIndex, MediumSet
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.prefix import as_token_array
from kvmesh.router.types import PrefixMatch

logger = logging.getLogger(__name__)

DEFAULT_MAX_BLOCKS_PER_POD = 1_000_000

PREFIX_KV_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
"""``kv_cache_spec_kind`` values whose blocks hold a full prefix (an untagged event counts too)."""

_Entry = tuple[BlockKey, int, int]
"""(our key, namespace id, MediumSet bits); for an expanded engine block, its last sub-key"""

_SubKeys = dict[ExternalBlockHash, tuple[BlockKey, ...]]
"""Per pod: the router keys of each engine block larger than a router block."""

_SLOWEST_FIRST = (Medium.SHARED, Medium.DISK, Medium.CPU, Medium.GPU)

_HAS_SPEC_KIND = "kv_cache_spec_kind" in BlockStored.__struct_fields__
"""Whether this events module carries vLLM 0.32's ``kv_cache_spec_kind`` (else it is always unset)."""

_NO_GROUP = -1
"""The group rank of events without ``group_idx`` (lowest: an untagged publisher has one group)."""


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
        self._pods: dict[PodId, dict[ExternalBlockHash, _Entry]] = {}
        self._sub_keys: dict[PodId, _SubKeys] = {}
        """Only pods with engine blocks larger than the router's have an entry."""
        self._block_sizes: dict[PodId, int] = {}
        self._groups: dict[PodId, int] = {}
        """The KV cache group indexed per pod (:data:`_NO_GROUP` for untagged events); only pods
        that announced a group or kind have an entry, so untagged streams skip the group checks."""
        self._noted: set[tuple[PodId, int, str]] = set()
        """(pod, block size or group, why) already logged: one line per pod and cause."""
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
        group = self._groups.get(pod, _NO_GROUP)
        return None if group == _NO_GROUP else group

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

        A pod whose blocks are ``k`` router blocks long is indexed with all ``k`` sub-keys of each
        block, so a prompt that leaves its cached prefix inside an engine block matches up to
        ``k - 1`` router blocks more than the engine can reuse (it only reuses whole blocks). This
        removes them; pods whose block size is the router's are untouched, and nothing is done when
        no pod has larger blocks. Trailing blocks are taken from the slowest tiers first (an engine
        evicts a chain's tail first).

        Returns:
            ``match``.
        """
        if not self._sub_keys or match.block_size != self.block_size:
            return match
        sizes = self._block_sizes
        bs = self.block_size
        dropped: list[PodId] = []
        for pod, pod_match in match.pods.items():
            per = sizes.get(pod, bs) // bs
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
        self._groups.pop(pod, None)
        return self._drop_blocks(pod)

    def forget_pod(self, pod: PodId) -> int:
        """:meth:`drop_pod`, and forget the pod's block size too (it left the fleet).

        Returns:
            Index entries dropped.
        """
        dropped = self.drop_pod(pod)
        self._block_sizes.pop(pod, None)
        self._noted = {note for note in self._noted if note[0] != pod}
        return dropped

    def _drop_blocks(self, pod: PodId) -> int:
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
        wanted = {
            i
            for i, ns in enumerate(self._namespaces)
            if (lora is None or ns.lora == lora) and (tenant is None or ns.tenant == tenant)
        }
        total = 0
        for pod, blocks in self._pods.items():
            gone = [h for h, (_, ns_id, _) in blocks.items() if ns_id in wanted]
            if gone:
                self.index.remove(self._pop_keys(pod, blocks, gone), pod)
                total += len(gone)
        return total

    def _pop_keys(
        self, pod: PodId, blocks: dict[ExternalBlockHash, _Entry], hashes: Sequence[ExternalBlockHash]
    ) -> list[BlockKey]:
        """Forget tracked ``hashes`` of ``pod``; their router keys, every sub-key included."""
        sub = self._sub_keys.get(pod)
        if sub is None:
            return [blocks.pop(h)[0] for h in hashes]
        keys: list[BlockKey] = []
        for h in hashes:
            key = blocks.pop(h)[0]
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
        if (
            ev.group_idx is not None
            or self._groups
            or (_HAS_SPEC_KIND and getattr(ev, "kv_cache_spec_kind", None) is not None)
        ) and not self._admit_group(pod, ev):
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
        engine_bs = ev.block_size
        self._block_sizes[pod] = engine_bs
        if engine_bs != bs:
            self._stored_resized(pod, ev, blocks, bits)
            return
        if len(tokens) < n * bs:
            self.stats.num_bad_events += 1
            return
        try:
            token_array = as_token_array(tokens[: n * bs] if len(tokens) > n * bs else tokens)
        except ValueError:
            self.stats.num_bad_events += 1
            return
        chain = self._chain_keys(ev, blocks, token_array, n)
        if chain is None:
            return
        parent_key, ns_id, keys = chain
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
            sub = self._sub_keys.get(pod)
            if sub:
                for h in hashes:
                    sub.pop(h, None)
        self.index.add(keys, pod, MediumSet(bits))
        self.stats.num_blocks_stored += n
        if len(blocks) > self.max_blocks_per_pod:
            self._overflow(pod, blocks)

    def _chain_keys(
        self,
        ev: BlockStored,
        blocks: dict[ExternalBlockHash, _Entry],
        token_array: np.ndarray,
        num_keys: int,
    ) -> tuple[BlockKey, int, list[BlockKey]] | None:
        """Router keys of ``num_keys`` router blocks of ``token_array``, chained from the event's
        root or from its parent's entry, as (parent key, namespace id, keys); ``None`` (counted) when
        the parent is unknown."""
        if ev.parent_block_hash is None:
            hasher, ns_id = self._hasher_entry(*self._chain_namespace(ev))
            return hasher.root, ns_id, hasher.hash_blocks(token_array, None, num_keys)
        parent = blocks.get(ev.parent_block_hash)
        if parent is None:
            self.stats.num_orphans += 1
            return None
        ns_id = parent[1]
        ns = self._namespaces[ns_id]
        hasher = self._hasher_entry(ns.lora, ns.tenant)[0]
        return parent[0], ns_id, hasher.hash_blocks(token_array, parent[0], num_keys)

    def _stored_resized(
        self, pod: PodId, ev: BlockStored, blocks: dict[ExternalBlockHash, _Entry], bits: int
    ) -> None:
        """A BlockStored whose engine block size differs from the router's."""
        bs = self.block_size
        engine_bs = ev.block_size
        if engine_bs <= 0:
            self.stats.num_bad_events += 1
            return
        if engine_bs % bs:
            self.stats.num_block_size_mismatch += 1
            self._warn_mismatch(pod, engine_bs)
            return
        hashes = ev.block_hashes
        n = len(hashes)
        per = engine_bs // bs
        tokens = ev.token_ids
        need = n * engine_bs
        if len(tokens) < need:
            self.stats.num_bad_events += 1
            return
        try:
            token_array = as_token_array(tokens[:need] if len(tokens) > need else tokens)
        except ValueError:
            self.stats.num_bad_events += 1
            return
        if (pod, engine_bs, "size") not in self._noted:
            self._noted.add((pod, engine_bs, "size"))
            logger.info(
                "pod %s publishes %d-token KV blocks: each is indexed as %d router blocks of %d tokens",
                pod,
                engine_bs,
                per,
                bs,
            )
        # An expanded parent's entry holds its last sub-key: the chain value after its tokens.
        chain = self._chain_keys(ev, blocks, token_array, n * per)
        if chain is None:
            return
        parent_key, ns_id, keys = chain
        if self.memo is not None:
            # Router-block granularity: n * per keys over the same n * engine_bs tokens.
            self.memo.remember(parent_key, token_array.tobytes(), keys)
        sub = self._sub_keys.get(pod)
        if sub is None:
            sub = self._sub_keys[pod] = {}
        get = blocks.get
        for i, h in enumerate(hashes):
            expanded = tuple(keys[i * per : (i + 1) * per])
            old = get(h)
            blocks[h] = (expanded[-1], ns_id, bits if old is None else old[2] | bits)
            sub[h] = expanded
        self.index.add(keys, pod, MediumSet(bits))
        self.stats.num_blocks_stored += n
        if len(blocks) > self.max_blocks_per_pod:
            self._overflow(pod, blocks)

    def _warn_mismatch(self, pod: PodId, engine_bs: int) -> None:
        if (pod, engine_bs, "mismatch") in self._noted:
            return
        self._noted.add((pod, engine_bs, "mismatch"))
        fix = math.gcd(engine_bs, *(size for size in self._block_sizes.values() if size > 0))
        logger.warning(
            "pod %s publishes %d-token KV blocks, which the router's %d-token blocks do not divide: "
            "its KV events are skipped and it is routed by load only. Set the router's blockSize to "
            "%d (--block-size %d), which divides the block size of every pod seen so far",
            pod,
            engine_bs,
            self.block_size,
            fix,
            fix,
        )

    def _admit_group(self, pod: PodId, ev: BlockStored) -> bool:
        """Whether a BlockStored of this KV cache group is indexed for ``pod``."""
        kind = getattr(ev, "kv_cache_spec_kind", None)
        group = _NO_GROUP if ev.group_idx is None else ev.group_idx
        if kind is not None and kind not in PREFIX_KV_KINDS:
            self.stats.num_skipped_groups += 1
            if (pod, group, "kind") not in self._noted:
                self._noted.add((pod, group, "kind"))
                logger.info(
                    "pod %s: KV cache group %s (%s) is not indexed: only full-attention groups hold "
                    "reusable prefixes",
                    pod,
                    ev.group_idx,
                    kind,
                )
            return False
        chosen = self._groups.get(pod)
        if chosen == group:
            return True
        if chosen is None or group < chosen:
            if chosen is not None:
                # A lower full-attention group showed up (events seen from mid-stream): index that
                # one. The other group's blocks leave, since its removals will no longer be followed.
                logger.info("pod %s: indexing KV cache group %s instead of %s", pod, ev.group_idx, chosen)
                self._drop_blocks(pod)
            self._groups[pod] = group
            return True
        self.stats.num_skipped_groups += 1
        return False

    def _add_tier(
        self,
        pod: PodId,
        blocks: dict[ExternalBlockHash, _Entry],
        hashes: Sequence[ExternalBlockHash],
        bits: int,
    ) -> None:
        sub = self._sub_keys.get(pod)
        keys: list[BlockKey] = []
        num_added = 0
        for h in hashes:
            entry = blocks.get(h)
            if entry is None:
                self.stats.num_unknown_hashes += 1
                continue
            blocks[h] = (entry[0], entry[1], entry[2] | bits)
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
        group = ev.group_idx
        if (group is not None or self._groups) and not self._in_indexed_group(pod, group):
            self.stats.num_skipped_groups += 1
            return
        blocks = self._pods.get(pod)
        if blocks is None:
            self.stats.num_unknown_hashes += len(ev.block_hashes)
            return
        bits = MEDIUM_BITS[Medium.parse(ev.medium)]
        if self._sub_keys and pod in self._sub_keys:
            self._removed_expanded(pod, blocks, self._sub_keys[pod], ev.block_hashes, bits)
            return
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

    def _removed_expanded(
        self,
        pod: PodId,
        blocks: dict[ExternalBlockHash, _Entry],
        sub: _SubKeys,
        hashes: Sequence[ExternalBlockHash],
        bits: int,
    ) -> None:
        """:meth:`_removed` for a pod with engine blocks larger than the router's."""
        keys: list[BlockKey] = []
        num_removed = 0
        for h in hashes:
            entry = blocks.get(h)
            if entry is None:
                self.stats.num_unknown_hashes += 1
                continue
            left = entry[2] & ~bits
            if left:
                blocks[h] = (entry[0], entry[1], left)
                expanded = sub.get(h)
            else:
                del blocks[h]
                expanded = sub.pop(h, None)
            if expanded is None:
                keys.append(entry[0])
            else:
                keys.extend(expanded)
            num_removed += 1
        if keys:
            self.index.remove(keys, pod, MediumSet(bits))
            self.stats.num_blocks_removed += num_removed

    def _in_indexed_group(self, pod: PodId, group_idx: int | None) -> bool:
        """Whether a BlockRemoved of this group concerns the group indexed for ``pod``."""
        group = _NO_GROUP if group_idx is None else group_idx
        return self._groups.get(pod, group) == group

    def _overflow(self, pod: PodId, blocks: dict[ExternalBlockHash, _Entry]) -> None:
        excess = len(blocks) - self.max_blocks_per_pod
        oldest = []
        for h in blocks:
            oldest.append(h)
            if len(oldest) >= excess:
                break
        self.index.remove(self._pop_keys(pod, blocks, oldest), pod)
        self.stats.num_overflow += len(oldest)

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
