"""PodBlocks (one pod's engine blocks) and SharedKeyRefs: exact keys, counts and order."""

from __future__ import annotations

from kvmesh.core.types import BlockKey, Medium
from kvmesh.router.index import MEDIUM_BITS
from kvmesh.router.pod_blocks import BlockEntry, PodBlocks
from kvmesh.router.shared_refs import SharedKeyRefs

GPU = MEDIUM_BITS[Medium.GPU]
CPU = MEDIUM_BITS[Medium.CPU]


def k(i: int) -> BlockKey:
    return BlockKey(bytes([i]) * 16)


def test_new_blocks_in_the_usual_tier_and_first_namespace():
    blocks = PodBlocks(GPU)
    touched = blocks.store([1, 2], [k(1), k(2)], 0, GPU)
    assert touched.keys == touched.new_keys == [k(1), k(2)]
    assert touched.num_blocks == 2
    assert blocks.entry(1) == BlockEntry(k(1), 0, GPU)
    assert blocks.entry(3) is None
    assert len(blocks) == 2 and blocks.num_router_keys() == 2


def test_other_namespace_and_tier_kept_per_block():
    blocks = PodBlocks(GPU)
    blocks.store([1], [k(1)], 3, CPU)
    assert blocks.entry(1) == BlockEntry(k(1), 3, CPU)
    again = blocks.store([1], [k(1)], 3, GPU)
    assert again.new_keys == []
    assert blocks.entry(1) == BlockEntry(k(1), 3, CPU | GPU)


def test_tiers_added_and_removed_block_forgotten_only_when_in_no_tier():
    blocks = PodBlocks(GPU)
    blocks.store([1, 2], [k(1), k(2)], 0, GPU)
    added = blocks.add_media([2, 9], CPU)
    assert (added.keys, added.num_blocks, added.num_unknown) == ([k(2)], 1, 1)
    removed = blocks.remove_media([1, 2], GPU)
    assert (removed.keys, removed.num_blocks, removed.num_unknown) == ([k(1), k(2)], 2, 0)
    assert blocks.entry(1) is None
    assert blocks.entry(2) == BlockEntry(k(2), 0, CPU)
    assert blocks.remove_media([2], CPU).keys == [k(2)]
    assert len(blocks) == 0


def test_expanded_engine_blocks_name_every_sub_key_and_chain_from_the_last():
    blocks = PodBlocks(GPU)
    touched = blocks.store([7, 8], [k(1), k(2), k(3), k(4)], 0, GPU)
    assert touched.new_keys == [k(1), k(2), k(3), k(4)]
    assert blocks.entry(7) == BlockEntry(k(2), 0, GPU)
    assert blocks.num_router_keys() == 4
    assert blocks.add_media([8], CPU).keys == [k(3), k(4)]
    assert blocks.remove_media([7], GPU).keys == [k(1), k(2)]
    assert blocks.num_router_keys() == 2
    # stored again at the router's size, the block is no longer expanded
    blocks.store([8], [k(9)], 0, GPU)
    assert blocks.pop_oldest(1) == [k(9)]


def test_adopted_blocks_keep_their_keys_and_move_last_when_adopted_again():
    pod = PodBlocks(GPU)
    pod.store([1, 2], [k(1), k(2), k(3), k(4)], 2, GPU)
    pod.store([3], [k(5)], 0, GPU)
    shared = PodBlocks(MEDIUM_BITS[Medium.SHARED])
    first = shared.adopt(pod, [1, 3, 4])
    assert first.keys == first.new_keys == [k(1), k(2), k(5)]
    assert first.num_unknown == 1
    assert shared.entry(1) == BlockEntry(k(2), 2, MEDIUM_BITS[Medium.SHARED])
    again = shared.adopt(pod, [1])
    assert again.keys == [k(1), k(2)] and again.new_keys == []
    assert shared.pop_oldest(1) == [k(5)]


def test_oldest_first_and_namespaces_popped():
    blocks = PodBlocks(GPU)
    blocks.store([1, 2], [k(1), k(2)], 0, GPU)
    blocks.store([3, 4], [k(3), k(4)], 5, GPU)
    keys, num_blocks = blocks.pop_namespaces({5})
    assert (keys, num_blocks) == ([k(3), k(4)], 2)
    assert blocks.pop_oldest(1) == [k(1)]
    assert [blocks.entry(h) for h in (1, 2)] == [None, BlockEntry(k(2), 0, GPU)]
    blocks.block_size = 16
    blocks.clear()
    assert len(blocks) == 0 and blocks.block_size == 16


def test_shared_key_leaves_with_the_last_block_naming_it():
    refs = SharedKeyRefs()
    refs.add([k(1), k(2)])
    refs.add([k(2), k(3)])
    assert refs.release([k(2)]) == []
    assert refs.release([k(1), k(2)]) == [k(1), k(2)]
    assert refs.release([k(3)]) == [k(3)]
