"""One pod's engine blocks as the event applier tracks them.

A KV event names blocks by the engine's own hashes; the index is keyed by the router's keys. Per
pod, :class:`PodBlocks` maps one to the other, oldest first::

    engine hash ──► BlockEntry(key, ns_id, media)    or the key alone: namespace 0, the usual tier
    engine hash ──► (sub-key 0, ..., sub-key k-1)     only for engine blocks k times the router's

An expanded engine block's entry holds its last sub-key (the chain value after its tokens), so a
chain continues from it like from any other block.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import NamedTuple, cast

from kvmesh.core.types import BlockKey, ExternalBlockHash


class BlockEntry(NamedTuple):
    """What the router knows of one engine block."""

    key: BlockKey
    """The router key (of an expanded engine block: its last sub-key)."""
    ns_id: int
    """The chain's namespace id (:class:`~kvmesh.router.chain_namespaces.ChainNamespaces`)."""
    media: int
    """The tiers holding it, as :class:`~kvmesh.router.index.MediumSet` bits."""


@dataclass(slots=True)
class Touched:
    """The outcome of one change to a pod's blocks, for the index and the counters."""

    keys: list[BlockKey] = field(default_factory=list)
    """Router keys of the blocks changed, every sub-key included."""
    new_keys: list[BlockKey] = field(default_factory=list)
    """Of those, the keys of blocks not tracked before."""
    num_blocks: int = 0
    """Engine blocks changed."""
    num_unknown: int = 0
    """Engine hashes named that are not tracked."""


class PodBlocks:
    """One pod's engine blocks, oldest first, and its engine block size.

    Nearly every block is in the first namespace (id 0) and in the pod's usual tier (the device
    tier; the shared tier for its holder); such a block is stored as its key alone, so a pod of a
    million blocks keeps a million keys, not a million tuples besides.

    Args:
        usual_bits: the MediumSet bits of the pod's usual tier.
    """

    __slots__ = ("_entries", "_sub_keys", "block_size", "usual_bits")

    def __init__(self, usual_bits: int) -> None:
        self.usual_bits = usual_bits
        self.block_size: int | None = None
        """Tokens per engine block, from the pod's latest BlockStored with tokens."""
        self._entries: dict[ExternalBlockHash, BlockKey | BlockEntry] = {}
        self._sub_keys: dict[ExternalBlockHash, tuple[BlockKey, ...]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, h: ExternalBlockHash) -> BlockEntry | None:
        """The entry of engine block ``h``, if tracked."""
        value = self._entries.get(h)
        if value is None or isinstance(value, BlockEntry):
            return value
        return BlockEntry(value, 0, self.usual_bits)

    def link(self, h: ExternalBlockHash) -> tuple[BlockKey, int] | None:
        """The (router key, namespace id) a chain continued from engine block ``h`` goes on from,
        if tracked (:meth:`entry` without building an entry: one lookup per chained event)."""
        value = self._entries.get(h)
        if value is None:
            return None
        if type(value) is bytes:
            return value, 0
        assert isinstance(value, BlockEntry), f"engine block {h!r} maps to a {type(value).__name__}"
        return value.key, value.ns_id

    def plain_keys_of(self, hashes: Iterable[ExternalBlockHash | None]) -> list[BlockKey] | None:
        """The router keys of blocks ``hashes`` (of an expanded block: its last sub-key), when every
        one is tracked in namespace 0 and the usual tier alone; ``None`` otherwise."""
        entries = cast(dict[ExternalBlockHash | None, BlockKey | BlockEntry], self._entries)
        found = list(map(entries.get, hashes))
        # A key alone is exact bytes; an entry of another shape or a miss (None) is not plain.
        if found and set(map(type, found)) != {bytes}:
            return None
        return cast(list[BlockKey], found)

    def tracks_none_of(self, hashes: Iterable[ExternalBlockHash]) -> bool:
        """Whether no engine block of ``hashes`` is tracked."""
        return self._entries.keys().isdisjoint(hashes)

    def num_router_keys(self) -> int:
        """Router keys the tracked blocks stand for."""
        return len(self._entries) + sum(len(keys) - 1 for keys in self._sub_keys.values())

    def clear(self) -> None:
        """Forget every block (the block size stays known)."""
        self._entries.clear()
        self._sub_keys.clear()

    def store(
        self,
        hashes: Sequence[ExternalBlockHash],
        keys: list[BlockKey],
        ns_id: int,
        bits: int,
        *,
        move_last: bool = False,
    ) -> Touched:
        """Track engine blocks ``hashes`` with their router keys, in ``bits``' tiers.

        Args:
            hashes: the engine blocks.
            keys: their router keys, ``len(keys) // len(hashes)`` per engine block (the returned
                :class:`Touched` holds this list itself).
            ns_id: the chain's namespace id.
            bits: the tiers the event names; a tracked block keeps its other tiers too.
            move_last: move a tracked block to the newest end (it was written again).

        Returns:
            ``keys`` and the keys of the blocks tracked for the first time.
        """
        per = len(keys) // len(hashes)
        assert per * len(hashes) == len(keys), f"{len(keys)} keys for {len(hashes)} engine blocks"
        entries = self._entries
        if per == 1 and entries.keys().isdisjoint(hashes):
            # The common case (new blocks of the router's size): every entry built at C speed.
            if ns_id == 0 and bits == self.usual_bits:
                entries.update(zip(hashes, keys, strict=True))
            else:
                entry = BlockEntry._make
                entries.update(
                    zip(hashes, map(entry, zip(keys, repeat(ns_id), repeat(bits), strict=False)), strict=True)
                )
            return Touched(keys, keys, len(hashes))
        touched = Touched(keys, [], len(hashes))
        sub = self._sub_keys
        for i, h in enumerate(hashes):
            old = entries.pop(h, None) if move_last else entries.get(h)
            block_keys = tuple(keys[i * per : (i + 1) * per])
            media = bits if old is None else self._media(old) | bits
            self._put(h, block_keys[-1], ns_id, media)
            if per == 1:
                sub.pop(h, None)
            else:
                sub[h] = block_keys
            if old is None:
                touched.new_keys.extend(block_keys)
        return touched

    def track_new(self, hashes: Sequence[ExternalBlockHash], keys: Sequence[BlockKey], bound: int) -> bool:
        """:meth:`store`'s common case without its outcome: track blocks none of which is
        tracked, one router key each, in namespace 0 and the usual tier, if that keeps at most
        ``bound`` blocks; ``False``, nothing changed, otherwise."""
        entries = self._entries
        if len(entries) + len(hashes) > bound or not entries.keys().isdisjoint(hashes):
            return False
        entries.update(zip(hashes, keys, strict=True))
        return True

    def add_media(self, hashes: Iterable[ExternalBlockHash], bits: int) -> Touched:
        """Add ``bits``' tiers to tracked blocks (an offload event without tokens)."""
        touched = Touched()
        keys = touched.keys
        for h, key, ns_id, media in self._known(hashes, touched):
            self._put(h, key, ns_id, media | bits)
            keys.extend(self._sub_keys.get(h, (key,)))
        return touched

    def remove_media(self, hashes: Sequence[ExternalBlockHash], bits: int) -> Touched:
        """Take ``bits``' tiers from tracked blocks; a block left in no tier is forgotten."""
        if not self.usual_bits & ~bits:
            if len(hashes) == 1:
                # One evicted block, as engines announce each: its key alone, if that is all it is.
                h = hashes[0]
                key = self._entries.get(h)
                if type(key) is bytes and not (self._sub_keys and h in self._sub_keys):
                    del self._entries[h]
                    return Touched([key], [], 1, 0)
            evicted = self._evict_plain(hashes)
            if evicted is not None:
                return evicted
        return self._remove_media_each(hashes, bits)

    def _remove_media_each(self, hashes: Iterable[ExternalBlockHash], bits: int) -> Touched:
        """:meth:`remove_media` block by block, whatever the blocks' shapes."""
        touched = Touched()
        keys = touched.keys
        entries, sub = self._entries, self._sub_keys
        for h, key, ns_id, media in self._known(hashes, touched):
            left = media & ~bits
            if left:
                self._put(h, key, ns_id, left)
                keys.extend(sub.get(h, (key,)))
            else:
                if entries.pop(h, None) is None:
                    # Named twice: gone with its first mention, so this one is unknown.
                    touched.num_blocks -= 1
                    touched.num_unknown += 1
                    continue
                if sub:
                    keys.extend(sub.pop(h, (key,)))
                else:
                    keys.append(key)
        return touched

    def _evict_plain(self, hashes: Sequence[ExternalBlockHash]) -> Touched | None:
        """:meth:`remove_media` of tiers that cover the usual one, in the common case (an
        eviction of tracked blocks stored as their key alone, none expanded) at C speed; ``None``,
        nothing changed, when some block is not such a case."""
        entries = self._entries
        found = list(map(entries.get, hashes))
        # A key alone is exact bytes; an entry of another shape or a miss (None) takes the plain path.
        if set(map(type, found)) != {bytes} or (
            self._sub_keys and not self._sub_keys.keys().isdisjoint(hashes)
        ):
            return None
        keys = cast(list[BlockKey], found)
        popped = list(map(entries.pop, hashes, repeat(None)))
        if None in popped:
            # A hash named twice: its later mentions find nothing, as one by one they would.
            keys = list(compress(keys, map(operator.is_not, popped, repeat(None))))
        return Touched(keys, [], len(keys), len(hashes) - len(keys))

    def adopt(self, source: PodBlocks, hashes: Iterable[ExternalBlockHash]) -> Touched:
        """Track ``source``'s blocks ``hashes`` here too, under the same engine hashes, in this
        pod's usual tier (a pod's blocks written to the shared tier); a block adopted again moves
        to the newest end."""
        touched = Touched()
        for h, key, ns_id, _ in source._known(hashes, touched):
            new = self._entries.pop(h, None) is None
            self._put(h, key, ns_id, self.usual_bits)
            expanded = source._sub_keys.get(h)
            if expanded is not None:
                self._sub_keys[h] = expanded
            block_keys = expanded or (key,)
            touched.keys.extend(block_keys)
            if new:
                touched.new_keys.extend(block_keys)
        return touched

    def pop_oldest(self, n: int) -> list[BlockKey]:
        """Forget the ``n`` oldest blocks; their router keys."""
        oldest: list[ExternalBlockHash] = []
        for h in self._entries:
            if len(oldest) >= n:
                break
            oldest.append(h)
        return self._pop(oldest)

    def pop_namespaces(self, ns_ids: Collection[int]) -> tuple[list[BlockKey], int]:
        """Forget the blocks of namespaces ``ns_ids``; their router keys and how many blocks."""
        gone = [h for h, value in self._entries.items() if self._ns_id(value) in ns_ids]
        return self._pop(gone), len(gone)

    def _pop(self, hashes: Sequence[ExternalBlockHash]) -> list[BlockKey]:
        entries, sub = self._entries, self._sub_keys
        if not sub:
            return [self._key(entries.pop(h)) for h in hashes]
        keys: list[BlockKey] = []
        for h in hashes:
            key = self._key(entries.pop(h))
            keys.extend(sub.pop(h, (key,)))
        return keys

    def _known(
        self, hashes: Iterable[ExternalBlockHash], touched: Touched
    ) -> list[tuple[ExternalBlockHash, BlockKey, int, int]]:
        """The tracked blocks of ``hashes`` as (engine hash, key, namespace id, media), counted in
        ``touched``; the others counted as unknown."""
        entries, usual = self._entries, self.usual_bits
        found: list[tuple[ExternalBlockHash, BlockKey, int, int]] = []
        for h in hashes:
            value = entries.get(h)
            if value is None:
                touched.num_unknown += 1
            elif isinstance(value, BlockEntry):
                found.append((h, *value))
            else:
                found.append((h, value, 0, usual))
        touched.num_blocks += len(found)
        return found

    def _put(self, h: ExternalBlockHash, key: BlockKey, ns_id: int, bits: int) -> None:
        self._entries[h] = key if ns_id == 0 and bits == self.usual_bits else BlockEntry(key, ns_id, bits)

    def _media(self, value: BlockKey | BlockEntry) -> int:
        return value.media if isinstance(value, BlockEntry) else self.usual_bits

    @staticmethod
    def _ns_id(value: BlockKey | BlockEntry) -> int:
        return value.ns_id if isinstance(value, BlockEntry) else 0

    @staticmethod
    def _key(value: BlockKey | BlockEntry) -> BlockKey:
        return value.key if isinstance(value, BlockEntry) else value
