"""LocalTierAnnouncer: local-tier reports become CPU/DISK events the router's index applies exactly.

A simulated device tier, a stand-in store that reports what the test says, and the router's own
EventApplier over an InMemoryIndex; events are applied in the engine's order (device tier first).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvmesh.core.events import BlockRemoved, BlockStored, KVEvent
from kvmesh.core.hashing import HashAlgo
from kvmesh.core.types import BlockKey, ExternalBlockHash, Medium, PodId
from kvmesh.engine.local_tiers import LocalTierAnnouncer
from kvmesh.engine.prefix_cache import PrefixCache, engine_block_hash
from kvmesh.engine.store_connector import LocalTierChanged, LocalTiers
from kvmesh.router.index import InMemoryIndex, MediumSet, medium_set
from kvmesh.router.ingest import EventApplier
from kvmesh.store.keys import StoreKey

POD = PodId("engine-0")
BS = 16
CHUNK = 64  # four blocks
A = list(range(1000, 1128))  # two chunks
B = list(range(2000, 2128))
GPU, CPU, DISK = medium_set(Medium.GPU), medium_set(Medium.CPU), medium_set(Medium.DISK)


class Store:
    """The PrefixStore surface the announcer uses: local tiers that report what a test says."""

    chunk_size = CHUNK

    def __init__(self, cache: PrefixCache, media: tuple[Medium, ...] = (Medium.CPU, Medium.DISK)) -> None:
        self.cache = cache
        self.media = media
        self.listener: LocalTierChanged | None = None

    def watch_local_tiers(self, listener: LocalTierChanged) -> LocalTiers | None:
        self.listener = listener
        return LocalTiers(self.media, self.chunk_keys) if self.media else None

    def chunk_keys(self, tokens: list[int], tenant: str) -> list[StoreKey]:
        keys = self.cache.block_keys(tokens, tenant)
        return [StoreKey("00000000000000aa", k) for k in keys[CHUNK // BS - 1 :: CHUNK // BS]]

    def report(
        self, medium: Medium, stored: Sequence[StoreKey] = (), removed: Sequence[StoreKey] = ()
    ) -> None:
        assert self.listener is not None
        self.listener(medium, list(stored), list(removed))


class Fleet:
    """One engine's device tier and announcer, the router's index, and the events between them."""

    def __init__(
        self, capacity_tokens: int = 256, max_chunks: int = 1 << 16, max_pending: int = 1 << 12
    ) -> None:
        self.cache = PrefixCache.create_simulated(capacity_tokens, BS)
        self.store = Store(self.cache)
        self.announcer = LocalTierAnnouncer(self.cache, CHUNK, max_chunks=max_chunks, max_pending=max_pending)
        assert self.announcer.listen(self.store)  # type: ignore[arg-type]
        self.index = InMemoryIndex()
        self.applier = EventApplier(self.index, model="sim", block_size=BS, algo=HashAlgo.XXH3)
        self.published: list[KVEvent] = []

    def compute(self, tokens: list[int], tenant: str = "") -> list[BlockKey]:
        """A request computes ``tokens`` (cached on the device) and queues its store write."""
        keys = self.cache.block_keys(tokens, tenant)
        have = self.cache.match(keys)
        alloc = self.cache.allocate("req", keys, have, len(keys) - have)
        assert alloc is not None
        self.cache.cache_blocks(alloc, keys, tokens, tenant=tenant)
        self.cache.free(alloc)
        self.announcer.expect(tokens, keys, tenant)
        return keys

    def chunks(self, tokens: list[int], tenant: str = "") -> list[StoreKey]:
        return self.store.chunk_keys(tokens, tenant)

    def publish(self) -> list[KVEvent]:
        """What the engine's loop does: the device tier's events, then the store's."""
        events = self.cache.take_events()
        device = len(events)
        events += self.announcer.take_events()
        for event in events:
            self.applier.apply(POD, event)
        self.published += events
        return events[device:]

    def media(self, keys: list[BlockKey]) -> list[MediumSet]:
        """The tiers the index says the engine holds each of ``keys`` in, up to the first it lacks."""
        return [holders[POD] for holders in self.index.lookup(keys) if POD in holders]


def hashes(keys: list[BlockKey]) -> list[ExternalBlockHash]:
    return [engine_block_hash(k) for k in keys]


def test_a_chunk_the_device_holds_is_announced_without_tokens_and_outlives_the_device() -> None:
    fleet = Fleet()
    keys = fleet.compute(A)
    c0, c1 = fleet.chunks(A)
    fleet.publish()
    fleet.store.report(Medium.CPU, stored=[c0, c1])
    (event,) = fleet.publish()
    assert event == BlockStored(
        block_hashes=hashes(keys), parent_block_hash=None, token_ids=[], block_size=BS, medium="CPU"
    )
    assert fleet.media(keys) == [GPU | CPU] * 8

    fleet.compute(B)
    fleet.compute(list(range(3000, 3128)))  # the device holds 16 blocks: A's eight go
    assert fleet.cache.match(keys) == 0
    fleet.publish()
    assert fleet.media(keys) == [CPU] * 8, "the device evicted A; the engine's RAM still holds it"

    fleet.store.report(Medium.CPU, removed=[c1])
    assert fleet.publish() == [BlockRemoved(block_hashes=hashes(keys[4:]), medium="CPU")]
    assert fleet.media(keys) == [CPU] * 4
    fleet.store.report(Medium.CPU, removed=[c0])
    assert fleet.publish() == [BlockRemoved(block_hashes=hashes(keys[:4]), medium="CPU")]
    assert fleet.index.lookup(keys) == []
    assert fleet.announcer.num_announced == 0


@pytest.mark.parametrize("tenant", ["", "acme"])
def test_chunks_the_device_evicted_first_carry_their_tokens(tenant: str) -> None:
    fleet = Fleet(capacity_tokens=128)
    keys = fleet.compute(A, tenant)
    fleet.compute(B)  # evicts A from the device before A's write lands
    fleet.publish()
    assert fleet.cache.match(keys) == 0 and fleet.index.lookup(keys) == []
    c0, c1 = fleet.chunks(A, tenant)
    fleet.store.report(Medium.CPU, stored=[c0, c1])
    first, second = fleet.publish()
    extra_keys = [[tenant], None, None, None] if tenant else None
    assert first == BlockStored(
        block_hashes=hashes(keys[:4]),
        parent_block_hash=None,
        token_ids=A[:64],
        block_size=BS,
        medium="CPU",
        extra_keys=extra_keys,
    )
    assert second == BlockStored(
        block_hashes=hashes(keys[4:]),
        parent_block_hash=engine_block_hash(keys[3]),
        token_ids=A[64:],
        block_size=BS,
        medium="CPU",
        extra_keys=extra_keys,
    )
    assert fleet.media(keys) == [CPU] * 8
    fleet.store.report(Medium.CPU, removed=[c0, c1])
    assert fleet.publish() == [BlockRemoved(block_hashes=hashes(keys), medium="CPU")]
    assert fleet.index.lookup(keys) == []


def test_a_chunk_no_prefix_match_could_reach_is_not_announced() -> None:
    fleet = Fleet(capacity_tokens=128)
    keys = fleet.compute(A)
    fleet.compute(B)
    fleet.publish()
    _, c1 = fleet.chunks(A)
    fleet.store.report(Medium.CPU, stored=[c1])  # chunk 0 is in no tier the router knows of
    assert fleet.publish() == []
    assert fleet.announcer.num_unannounced == 1
    fleet.store.report(Medium.CPU, removed=[c1])
    assert fleet.publish() == [], "nothing announced, nothing to remove"
    assert fleet.index.lookup(keys) == []


def test_the_second_local_tier_adds_its_medium_and_keeps_the_blocks_when_the_first_drops_them() -> None:
    fleet = Fleet(capacity_tokens=128)
    keys = fleet.compute(A)
    c0, c1 = fleet.chunks(A)
    fleet.store.report(Medium.CPU, stored=[c0, c1])
    fleet.publish()
    fleet.compute(B)
    fleet.publish()  # the device evicted A
    fleet.store.report(Medium.DISK, stored=[c0, c1])  # no device block: known through the CPU tier
    assert fleet.publish() == [
        BlockStored(
            block_hashes=hashes(keys), parent_block_hash=None, token_ids=[], block_size=BS, medium="DISK"
        )
    ]
    assert fleet.media(keys) == [CPU | DISK] * 8
    fleet.store.report(Medium.CPU, removed=[c0, c1])
    fleet.publish()
    assert fleet.media(keys) == [DISK] * 8
    fleet.store.report(Medium.DISK, stored=[c0])  # written again: announced already
    assert fleet.publish() == []
    fleet.store.report(Medium.DISK, removed=[c0, c1])
    assert fleet.publish() == [BlockRemoved(block_hashes=hashes(keys), medium="DISK")]
    assert fleet.index.lookup(keys) == []


def test_a_promoted_chunk_is_announced_from_the_prompt_its_load_named() -> None:
    fleet = Fleet()
    keys = fleet.cache.block_keys(A)
    fleet.announcer.expect(A, keys, "")  # a load, before its request is admitted
    fleet.store.report(Medium.CPU, stored=fleet.chunks(A))
    first, second = fleet.publish()
    assert (first.parent_block_hash, second.parent_block_hash) == (None, engine_block_hash(keys[3]))  # type: ignore[union-attr]
    assert fleet.media(keys) == [CPU] * 8
    fleet.compute(A)  # admitted: the device caches the loaded blocks
    fleet.publish()
    assert fleet.media(keys) == [GPU | CPU] * 8


def test_reports_of_unknown_chunks_and_after_a_device_reset_announce_nothing() -> None:
    fleet = Fleet()
    keys = fleet.compute(A)
    stranger = StoreKey("00000000000000aa", BlockKey(bytes(16)))
    fleet.store.report(Medium.CPU, stored=[stranger], removed=[stranger])
    fleet.publish()
    assert fleet.announcer.num_unannounced == 1
    assert fleet.media(keys) == [GPU] * 8
    fleet.store.report(Medium.CPU, stored=fleet.chunks(A))
    fleet.publish()
    assert fleet.cache.reset()
    fleet.announcer.forget()  # what the engine does when its device tier publishes AllBlocksCleared
    fleet.publish()
    assert fleet.index.lookup(keys) == []
    fleet.store.report(Medium.CPU, removed=fleet.chunks(A))
    assert fleet.publish() == []


def test_announced_and_pending_chunks_are_bounded() -> None:
    fleet = Fleet(max_chunks=1, max_pending=2)
    keys = fleet.compute(A)
    fleet.store.report(Medium.CPU, stored=fleet.chunks(A))
    (event,) = fleet.publish()
    assert event.block_hashes == hashes(keys[:4]) and fleet.announcer.num_unannounced == 1  # type: ignore[union-attr]
    fleet.compute(B)  # its two chunks push A's out of the pending prompts
    fleet.store.report(Medium.DISK, stored=fleet.chunks(A))
    (event,) = fleet.publish()
    assert event.block_hashes == hashes(keys[:4]), "announced chunks need no prompt"  # type: ignore[union-attr]
    assert fleet.announcer.num_unannounced == 2


def test_a_store_without_local_tiers_is_not_listened_to() -> None:
    cache = PrefixCache.create_simulated(256, BS)
    announcer = LocalTierAnnouncer(cache, CHUNK)
    assert not announcer.listen(Store(cache, media=()))  # type: ignore[arg-type]
    announcer.expect(A, cache.block_keys(A), "")
    assert announcer.take_events() == []
    with pytest.raises(ValueError, match="multiple"):
        LocalTierAnnouncer(cache, 40)
