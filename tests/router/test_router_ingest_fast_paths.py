"""Ingestion's batched fast paths leave exactly the state the block-by-block paths leave.

Each case drives two copies through the same random operations; the only difference is that one
takes the public method (fast path when it applies) and the other the plain per-block method.
"""

from __future__ import annotations

import hashlib
import random

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.events import BlockRemoved
from kvmesh.core.hashing import KEY_BYTES, BlockHasher, HashAlgo, Namespace, tokens_to_bytes
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.router.index import ALL_MEDIA, InMemoryIndex, MediumSet
from kvmesh.router.ingest import event_medium
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.pod_blocks import PodBlocks, Touched

GPU, CPU, DISK, SHARED = 1, 2, 4, 8
PODS = [PodId(f"p{i}") for i in range(3)]


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(KEY_BYTES, "little"))


def pod_block_state(blocks: PodBlocks) -> tuple[object, ...]:
    return list(blocks._entries.items()), list(blocks._sub_keys.items()), len(blocks)


def touched_state(touched: Touched) -> tuple[object, ...]:
    return touched.keys, touched.new_keys, touched.num_blocks, touched.num_unknown


pod_block_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "add", "remove", "remove"]),
        st.lists(st.integers(0, 30), min_size=1, max_size=8),
        st.sampled_from([GPU, CPU, GPU | CPU, DISK, ALL_MEDIA]),
        st.sampled_from([0, 0, 0, 1]),
        st.sampled_from([1, 1, 1, 2]),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(ops=pod_block_ops, usual=st.sampled_from([GPU, SHARED]))
def test_pod_blocks_removal_matches_block_by_block(ops, usual):
    fast, plain = PodBlocks(usual), PodBlocks(usual)
    for kind, hashes, bits, ns_id, per in ops:
        if kind == "store":
            unique = list(dict.fromkeys(hashes))
            keys = [k(h * 4 + j) for h in unique for j in range(per)]
            got = [b.store(unique, keys, ns_id, bits) for b in (fast, plain)]
        elif kind == "add":
            got = [b.add_media(hashes, bits) for b in (fast, plain)]
        else:
            got = [fast.remove_media(hashes, bits), plain._remove_media_each(hashes, bits)]
        assert touched_state(got[0]) == touched_state(got[1])
        assert pod_block_state(fast) == pod_block_state(plain)


index_ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "remove", "remove"]),
        st.integers(0, 2),
        st.lists(st.integers(0, 20), min_size=1, max_size=10),
        st.sampled_from([GPU, CPU, GPU | CPU, SHARED, ALL_MEDIA]),
    ),
    max_size=40,
)


def index_state(index: InMemoryIndex) -> tuple[object, ...]:
    return list(index._blocks.items()), index.stats()


@settings(max_examples=150, deadline=None)
@given(ops=index_ops, capacity=st.sampled_from([None, 12, 1000]))
def test_index_removal_matches_key_by_key(ops, capacity):
    fast, plain = InMemoryIndex(capacity), InMemoryIndex(capacity)
    for kind, pod_i, key_ids, media in ops:
        keys = [k(i) for i in key_ids]
        pod = PODS[pod_i]
        if kind == "add":
            fast.add(keys, pod, MediumSet(media))
            plain.add(keys, pod, MediumSet(media))
        else:
            fast.remove(keys, pod, MediumSet(media))
            plain._remove_each(keys, pod, MediumSet(media))
        assert index_state(fast) == index_state(plain)


def reference_chain(algo: HashAlgo, root: bytes, raw: bytes, stride: int) -> list[bytes]:
    keys, prev = [], root
    for off in range(0, len(raw) - stride + 1, stride):
        data = prev + raw[off : off + stride]
        prev = (
            hashlib.sha256(data).digest()[:KEY_BYTES]
            if algo is HashAlgo.SHA256
            else xxhash.xxh3_128_digest(data)
        )
        keys.append(prev)
    return keys


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    block_size=st.sampled_from([1, 3, 16]),
    algo=st.sampled_from(list(HashAlgo)),
    chained=st.booleans(),
)
def test_packed_hashing_matches_the_reference_chain(tokens, block_size, algo, chained):
    hasher = BlockHasher(Namespace("m"), block_size, algo)
    parent = k(7) if chained else None
    raw = tokens_to_bytes(tokens) if tokens else b""
    expected = reference_chain(algo, parent or hasher.root, raw, 4 * block_size)
    assert hasher.hash_packed(raw, parent) == expected
    assert hasher.hash_blocks(tokens, parent) == expected


def test_an_eviction_named_twice_counts_the_repeat_as_unknown_on_both_paths():
    rng = random.Random(3)
    hashes = rng.sample(range(100), 10)
    fast, plain = PodBlocks(GPU), PodBlocks(GPU)
    for b in (fast, plain):
        b.store(hashes, [k(h) for h in hashes], 0, GPU)
    named = [hashes[0], hashes[1], hashes[0]]
    got = fast.remove_media(named, GPU)
    assert touched_state(got) == touched_state(plain._remove_media_each(named, GPU))
    assert touched_state(got) == ([k(hashes[0]), k(hashes[1])], [], 2, 1)
    assert pod_block_state(fast) == pod_block_state(plain)


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    block_size=st.sampled_from([1, 3, 16]),
    algo=st.sampled_from(list(HashAlgo)),
    chained=st.booleans(),
    capacity=st.sampled_from([2, 5, 1000]),
)
def test_memo_from_digest_inputs_matches_the_memo_from_tokens(tokens, block_size, algo, chained, capacity):
    hasher = BlockHasher(Namespace("m"), block_size, algo)
    parent = k(7) if chained else None
    raw = tokens_to_bytes(tokens) if tokens else b""
    keys, inputs = hasher.hash_packed_with_inputs(raw, parent)
    assert keys == hasher.hash_packed(raw, parent)
    from_tokens, from_inputs = BlockKeyMemo(capacity), BlockKeyMemo(capacity)
    for memo in (from_tokens, from_inputs):
        memo.remember(k(1), b"\x01" * 4 * block_size, [k(2)])  # an older entry, evicted first
    whole = raw[: len(keys) * 4 * block_size]  # remember takes whole blocks, as ingestion passes
    from_tokens.remember(parent or hasher.root, whole, keys)
    from_inputs.remember_inputs(inputs, keys)
    assert list(from_tokens._keys.items()) == list(from_inputs._keys.items())
    assert from_tokens.num_evicted == from_inputs.num_evicted


@settings(max_examples=150, deadline=None)
@given(
    medium=st.one_of(
        st.none(),
        st.sampled_from(["GPU", "gpu", "CPU", "cpu_pinned", "DISK", "STORAGE", "LMCACHE", ""]),
        st.text(),
    ),
    locality=st.sampled_from([None, "LOCAL", "remote"]),
)
def test_the_parsed_media_cache_answers_as_parsing_does(medium, locality):
    event = BlockRemoved([1], medium=medium, locality=locality)
    expected = Medium.SHARED if locality == "remote" else Medium.parse(medium)
    assert event_medium(event) == expected
    assert event_medium(event) == expected  # the second time from the cache, if kept
