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

from kvmesh.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvmesh.core.hashing import KEY_BYTES, BlockHasher, HashAlgo, Namespace, tokens_to_bytes
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.router.cache_memory import RememberingIndex, SeenBlocks
from kvmesh.router.index import ALL_MEDIA, InMemoryIndex, MediumSet
from kvmesh.router.ingest import EventApplier, event_medium
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


# --------------------------------------------------------------------------------------------------
# apply_batch (plain BlockStored runs keyed by PlainStores, one index write per run) against the
# same events applied one by one through the general path.

BS = 4
_VOCAB = [7, 300, 70_000, 2**32 - 1]


def _event(rng: random.Random, kind: str, known: list[int], next_hash: list[int]) -> object:
    """One event of ``kind`` for a pod whose announced engine hashes are ``known``."""
    if kind == "removed":
        named = rng.sample(known, min(len(known), rng.randint(1, 3))) if known else [12345]
        return BlockRemoved(
            named, medium=rng.choice([None, None, "CPU"]), group_idx=rng.choice([None, None, 1])
        )
    if kind == "cleared":
        return AllBlocksCleared()
    n = rng.randint(1, 3)
    if kind == "again" and known:
        hashes = [rng.choice(known)]  # a block announced before: not plain
    else:
        hashes = list(range(next_hash[0], next_hash[0] + n))
        next_hash[0] += n
    # Mostly the newest block (a chain going on), sometimes any announced block or none.
    parent = (
        (known[-1] if rng.random() < 0.6 else rng.choice(known))
        if known and rng.random() < 0.8
        else rng.choice([None, None, 99_999])
    )
    size = rng.choice([BS] * 8 + [2 * BS, 3])
    # A small vocabulary repeats blocks, so router keys recur across events and pods.
    tokens = [rng.choice(_VOCAB[: rng.randint(1, 4)]) for _ in range(len(hashes) * size)]
    if rng.random() < 0.1:
        tokens = tokens[:-1] if rng.random() < 0.5 else tokens + [1] * rng.randint(1, 2 * size)
    return BlockStored(
        hashes,
        parent,
        tokens,
        size,
        medium=rng.choice([None, "GPU", "GPU", "CPU", "SHARED"]) if rng.random() < 0.15 else None,
        lora_name="l" if rng.random() < 0.05 else None,
        group_idx=rng.choice([None, 0, 0, 1]) if rng.random() < 0.1 else None,
        kv_cache_spec_kind=rng.choice(["full_attention", "sliding_window"]) if rng.random() < 0.1 else None,
    )


def _applier_state(applier: EventApplier, index: InMemoryIndex, seen: SeenBlocks) -> tuple[object, ...]:
    pods = {pod: (pod_block_state(blocks), blocks.block_size) for pod, blocks in applier._pods.items()}
    memo = None if applier.memo is None else list(applier.memo._keys.items())
    return (
        pods,
        list(index._blocks.items()),
        index.stats(),
        memo,
        list(seen._added.items()),
        list(seen._removed.items()),
        applier.stats,
        applier.pod_stats(),
    )


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_batches=st.integers(1, 25),
    per_pod=st.sampled_from([12, 40, 10_000]),
    capacity=st.sampled_from([None, 10_000]),
    memo=st.booleans(),
)
def test_batches_leave_what_events_applied_one_by_one_leave(seed, num_batches, per_pod, capacity, memo):
    rng = random.Random(seed)
    sides = []
    for _ in range(2):
        index = InMemoryIndex(capacity)
        seen = SeenBlocks(1000, clock=lambda: 1.0)
        applier = EventApplier(
            RememberingIndex(index, seen),
            model="m",
            block_size=BS,
            algo=HashAlgo.XXH3,
            max_blocks_per_pod=per_pod,
            memo=BlockKeyMemo(50) if memo else None,
        )
        sides.append((applier, index, seen))
    known: dict[PodId, list[int]] = {pod: [] for pod in PODS}
    next_hash = [1]
    kinds = ["plain"] * 16 + ["again", "removed", "removed", "cleared"]
    for _ in range(num_batches):
        pod = rng.choice(PODS)
        events = []
        tracked = sides[1][0]._pods.get(pod)
        tails = [] if tracked is None else [h for h, v in tracked._entries.items() if type(v) is bytes]
        if tails and rng.random() < 0.4:
            # Requests decoding: one new block each, continuing distinct chains the pod holds.
            for parent in rng.sample(tails, min(len(tails), rng.randint(2, 5))):
                tokens = [rng.choice(_VOCAB) for _ in range(BS)]
                events.append(BlockStored([next_hash[0]], parent, tokens, BS))
                next_hash[0] += 1
            known[pod].extend(h for ev in events for h in ev.block_hashes)
            # Evictions, one block each as vLLM announces them, of one tier or several.
            for h in rng.sample(known[pod], min(len(known[pod]), rng.randint(0, 4))):
                medium = rng.choice([None, None, "GPU", "CPU"])
                events.append(BlockRemoved([h], medium=medium, group_idx=rng.choice([None, None, 0])))
        for _ in range(rng.randint(0 if events else 1, 6 if not events else 1)):
            ev = _event(rng, rng.choice(kinds), known[pod], next_hash)
            if isinstance(ev, BlockStored):
                known[pod].extend(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                known[pod].clear()
            events.append(ev)
        (batched, _, _), (one_by_one, _, _) = sides
        batched.apply_batch(pod, KVEventBatch(0.0, events))
        for ev in events:
            one_by_one.apply(pod, ev)
        assert _applier_state(*sides[0]) == _applier_state(*sides[1])


def test_a_key_written_twice_in_one_batch_moves_as_it_does_event_by_event():
    tokens = [5] * BS
    batch = KVEventBatch(
        0.0,
        [
            BlockStored([1], None, tokens, BS),
            BlockStored([2], None, [6] * BS, BS),
            BlockStored([3], None, tokens, BS),  # the same router key as block 1
        ],
    )
    sides = []
    for _ in range(2):
        index = InMemoryIndex()
        applier = EventApplier(index, model="m", block_size=BS, algo=HashAlgo.XXH3)
        applier.apply(PODS[0], BlockStored([9], None, [8] * BS, BS))
        sides.append((applier, index))
    sides[0][0].apply_batch(PODS[0], batch)
    for ev in batch.events:
        sides[1][0].apply(PODS[0], ev)
    hasher = BlockHasher(Namespace("m"), BS, HashAlgo.XXH3)
    shared, second = hasher.hash_blocks(tokens)[0], hasher.hash_blocks([6] * BS)[0]
    # Blocks 1 and 3 share a key, which moved past block 2's when block 3 came.
    assert list(sides[0][1]._blocks)[1:] == [second, shared]
    assert list(sides[0][1]._blocks) == list(sides[1][1]._blocks)
