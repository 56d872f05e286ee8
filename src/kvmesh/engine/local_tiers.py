"""KV events for the store tiers only this engine reads: its RAM (``medium: CPU``) and local disk (``DISK``).

The router indexes device blocks; these tiers hold chunks of ``chunk_size`` tokens, keyed by the
chain value at a chunk's last block in the store's namespace. The tiers report the chunks they store
and drop (:meth:`~kvmesh.engine.store_connector.PrefixStore.watch_local_tiers`), and the engine,
which tells the store which prompt each write or load is for (:meth:`LocalTierAnnouncer.expect`),
turns the reports into vLLM's offloading events, as vLLM's own CPU offloading publishes them::

    tier stores chunk c  ─►  BlockStored  medium CPU|DISK  the device blocks of chunk c
    tier drops chunk c   ─►  BlockRemoved medium CPU|DISK  the same blocks

A ``BlockStored`` carries no tokens when the router knows the blocks already: the device tier still
holds them (its events are published first, so its ``BlockStored`` came before and any
``BlockRemoved`` would have too) or another local tier's announcement stands. Otherwise (the device
evicted them before the write landed, or a load promoted them before admission) it carries the
chunk's tokens, chained from the prompt's root for the first chunk or from the block before it when
the router knows that block; a chunk whose parent the router does not know is not announced (no
prefix match could reach it). The choice is made when the events are taken, right after the device
tier's, so it matches what the router will have seen.

Memory: one entry per announced chunk (its device blocks' engine hashes, 8 bytes each, and the
media announced), removed when the last of its tiers drops it, so bounded by what the tiers hold
and by ``max_chunks``; and the prompts of recent writes and loads (``max_pending`` chunks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.core.events import BlockRemoved, BlockStored, KVEvent
from kvmesh.core.types import BlockKey, ExternalBlockHash, Medium
from kvmesh.engine.prefix_cache import PrefixCache, engine_block_hash, prefix_stored_event
from kvmesh.engine.store_connector import PrefixStore

if TYPE_CHECKING:
    from kvmesh.store.keys import StoreKey

MAX_TRACKED_CHUNKS = 1 << 16
"""Announced chunks kept at most (about 200 bytes each for 16 blocks a chunk). A real model's chunk
is megabytes, so its tiers never hold this many; an emulated engine's placeholder chunks are 1 KiB,
and past the bound its new chunks go unannounced until announced ones leave."""
MAX_PENDING_CHUNKS = 1 << 12
"""Chunks of recent writes and loads whose prompt is kept for a report still to come."""

_BITS = {Medium.CPU: 1, Medium.DISK: 2}


@dataclass(slots=True)
class _Prompt:
    """A prompt whose chunks a local tier may store: what an announcement needs from it."""

    chunks: list[StoreKey]
    blocks: list[BlockKey]
    """Device block keys of the chunks, ``blocks_per_chunk`` each."""
    tokens: list[int]
    tenant: str


@dataclass(slots=True)
class _Announced:
    hashes: bytes
    """The chunk's device blocks' engine hashes, 8 bytes each, big-endian (as on the wire)."""
    media: int
    """Local tiers whose announcement of the chunk stands (bits of ``_BITS``)."""


class LocalTierAnnouncer:
    """Turns one engine's local-tier reports into KV events (after :meth:`listen`).

    Args:
        cache: the engine's device tier (what the router knows from its events).
        chunk_size: store chunk size, a multiple of the cache's block size.
        wake: called when events wait in :meth:`take_events` (a tier's background writer may
            report while the engine is idle).
        max_chunks: announced chunks kept at most (:data:`MAX_TRACKED_CHUNKS`).
        max_pending: chunks of recent prompts kept for reports to come (:data:`MAX_PENDING_CHUNKS`).
    """

    def __init__(
        self,
        cache: PrefixCache,
        chunk_size: int,
        *,
        wake: Callable[[], None] | None = None,
        max_chunks: int = MAX_TRACKED_CHUNKS,
        max_pending: int = MAX_PENDING_CHUNKS,
    ) -> None:
        if chunk_size <= 0 or chunk_size % cache.block_size:
            raise ValueError(f"chunk_size={chunk_size} is not a multiple of block_size={cache.block_size}")
        self.cache = cache
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // cache.block_size
        self.max_chunks = max_chunks
        self.max_pending = max_pending
        self.num_unannounced = 0
        """Chunks a tier stored that were not announced (no prompt known, parent unknown, bound)."""
        self._wake = wake
        self._chunk_keys: Callable[[list[int], str], list[StoreKey]] | None = None
        self._all_media = 0
        self._reports: list[tuple[Medium, list[StoreKey], list[StoreKey]]] = []
        self._announced: dict[StoreKey, _Announced] = {}
        self._pending: OrderedDict[StoreKey, tuple[_Prompt, int]] = OrderedDict()

    def listen(self, store: PrefixStore) -> bool:
        """Hear ``store``'s local tiers from now on.

        Returns:
            ``False`` when the store has no tier only this engine reads (nothing to announce).
        """
        tiers = store.watch_local_tiers(self.on_change)
        if tiers is None:
            return False
        unknown = [m for m in tiers.media if m not in _BITS]
        assert not unknown, f"the store reports local tiers {unknown}: only CPU and DISK are local"
        self._chunk_keys = tiers.chunk_keys
        self._all_media = 0
        for m in tiers.media:
            self._all_media |= _BITS[m]
        return True

    @property
    def num_announced(self) -> int:
        """Chunks whose announcement stands in at least one tier."""
        return len(self._announced)

    def expect(
        self,
        tokens: list[int],
        blocks: Sequence[BlockKey],
        tenant: str,
        chunks: Sequence[StoreKey] | None = None,
    ) -> None:
        """A write or load of a prompt's full chunks is about to reach the store: a local tier
        may report them (a write stores them, a load promotes them).

        Args:
            tokens: the prompt's tokens up to its last full chunk (kept, not copied).
            blocks: the prompt's device block keys (at least those of the full chunks).
            tenant: the request's tenant (``extra_keys`` of a chain's first block).
            chunks: the prompt's store keys (at least those of ``tokens``' full chunks), when the
                caller has them; computed here otherwise.
        """
        if self._chunk_keys is None:
            return
        num_chunks = len(tokens) // self.chunk_size
        num_blocks = num_chunks * self.blocks_per_chunk
        if num_blocks == 0 or len(blocks) < num_blocks:
            return
        chunks = self._chunk_keys(tokens, tenant) if chunks is None else list(chunks[:num_chunks])
        assert len(chunks) * self.blocks_per_chunk == num_blocks, "the store keys other chunks"
        prompt = _Prompt(chunks, list(blocks[:num_blocks]), tokens, tenant)
        pending = self._pending
        for c, chunk in enumerate(chunks):
            pending[chunk] = (prompt, c)
            pending.move_to_end(chunk)
        while len(pending) > self.max_pending:
            pending.popitem(last=False)

    def on_change(self, medium: Medium, stored: list[StoreKey], removed: list[StoreKey]) -> None:
        """A local tier's report (the store's listener)."""
        self._reports.append((medium, stored, removed))
        if self._wake is not None:
            self._wake()

    def forget(self) -> None:
        """The router dropped every block of this engine (``AllBlocksCleared``): no announcement stands."""
        self._announced.clear()

    def take_events(self) -> list[KVEvent]:
        """Events for the reports since the last call, oldest first.

        Call right after taking the device tier's events, and publish these after those.
        """
        reports, self._reports = self._reports, []
        out = _Events(self.cache.block_size)
        for medium, stored, removed in reports:
            for chunk in removed:
                self._removed(chunk, medium, out)
            for chunk in stored:
                self._stored(chunk, medium, out)
        return out.done()

    def _removed(self, chunk: StoreKey, medium: Medium, out: _Events) -> None:
        entry = self._announced.get(chunk)
        bit = _BITS[medium]
        if entry is None or not entry.media & bit:
            return
        entry.media &= ~bit
        if not entry.media:
            del self._announced[chunk]
        out.removed(medium, entry.hashes)

    def _stored(self, chunk: StoreKey, medium: Medium, out: _Events) -> None:
        bit = _BITS[medium]
        entry = self._announced.get(chunk)
        if entry is not None:
            # Another local tier's announcement stands: the router knows these blocks.
            if not entry.media & bit:
                entry.media |= bit
                out.known(medium, entry.hashes)
            self._maybe_settle(chunk, entry)
            return
        source = self._pending.get(chunk)
        if source is None or len(self._announced) >= self.max_chunks:
            self.num_unannounced += 1
            return
        prompt, c = source
        per = self.blocks_per_chunk
        blocks = prompt.blocks[c * per : (c + 1) * per]
        hashes = b"".join(key[:8] for key in blocks)
        cache = self.cache
        if all(key in cache for key in blocks):
            out.known(medium, hashes)
        elif c == 0:
            bs = cache.block_size
            out.event(prefix_stored_event(blocks, prompt.tokens, bs, prompt.tenant, medium))
        elif prompt.blocks[c * per - 1] in cache or prompt.chunks[c - 1] in self._announced:
            out.event(self._continued(prompt, c, medium))
        else:
            self.num_unannounced += 1
            return
        entry = self._announced[chunk] = _Announced(hashes, bit)
        self._maybe_settle(chunk, entry)

    def _continued(self, prompt: _Prompt, c: int, medium: Medium) -> BlockStored:
        """Chunk ``c`` of ``prompt`` with its tokens, chained from the block before it."""
        per = self.blocks_per_chunk
        blocks = prompt.blocks[c * per : (c + 1) * per]
        start = c * self.chunk_size
        return BlockStored(
            block_hashes=[engine_block_hash(key) for key in blocks],
            parent_block_hash=engine_block_hash(prompt.blocks[c * per - 1]),
            token_ids=list(prompt.tokens[start : start + self.chunk_size]),
            block_size=self.cache.block_size,
            medium=medium.value,
            # As the device tier writes a continued chain: the tenant on the event's first block.
            extra_keys=[[prompt.tenant] if i == 0 else None for i in range(per)] if prompt.tenant else None,
        )

    def _maybe_settle(self, chunk: StoreKey, entry: _Announced) -> None:
        """Every local tier announced the chunk: its prompt is no longer needed for it."""
        if entry.media == self._all_media:
            self._pending.pop(chunk, None)


class _Events:
    """Events in order; consecutive token-less announcements of one kind and tier make one event."""

    __slots__ = ("_block_size", "_events", "_hashes", "_medium", "_removing")

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._events: list[KVEvent] = []
        self._removing = False
        self._medium = Medium.CPU
        self._hashes: list[bytes] = []

    def known(self, medium: Medium, hashes: bytes) -> None:
        """A token-less ``BlockStored``: the router knows these blocks."""
        self._add(False, medium, hashes)

    def removed(self, medium: Medium, hashes: bytes) -> None:
        self._add(True, medium, hashes)

    def event(self, event: KVEvent) -> None:
        self._flush()
        self._events.append(event)

    def done(self) -> list[KVEvent]:
        self._flush()
        return self._events

    def _add(self, removing: bool, medium: Medium, hashes: bytes) -> None:
        if removing is not self._removing or medium is not self._medium:
            self._flush()
            self._removing, self._medium = removing, medium
        self._hashes.append(hashes)

    def _flush(self) -> None:
        if not self._hashes:
            return
        blob = b"".join(self._hashes)
        self._hashes = []
        hashes: list[ExternalBlockHash] = [
            int.from_bytes(blob[i : i + 8], "big") for i in range(0, len(blob), 8)
        ]
        medium = self._medium.value
        if self._removing:
            self._events.append(BlockRemoved(block_hashes=hashes, medium=medium))
            return
        self._events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=[],
                block_size=self._block_size,
                medium=medium,
            )
        )
