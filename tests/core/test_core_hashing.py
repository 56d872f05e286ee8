import dataclasses
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.hashing import KEY_BYTES, BlockHasher, HashAlgo, Namespace, key_from_hex, tokens_to_bytes

token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=0, max_size=200)
algos = st.sampled_from([HashAlgo.SHA256, HashAlgo.XXH3])
block_sizes = st.sampled_from([1, 2, 4, 16])


def test_chain_matches_spec_by_hand():
    ns = Namespace("m")
    hasher = BlockHasher(ns, block_size=2)
    root = hashlib.sha256(ns.encode()).digest()[:16]
    h1 = hashlib.sha256(root + (5).to_bytes(4, "little") + (7).to_bytes(4, "little")).digest()[:16]
    h2 = hashlib.sha256(h1 + (9).to_bytes(4, "little") + (2**32 - 1).to_bytes(4, "little")).digest()[:16]
    assert hasher.hash_blocks([5, 7, 9, 2**32 - 1, 3]) == [h1, h2]
    assert hasher.root == root


def test_only_full_blocks_are_keyed():
    hasher = BlockHasher(Namespace("m"), block_size=16)
    assert hasher.hash_blocks(list(range(15))) == []
    assert len(hasher.hash_blocks(list(range(47)))) == 2


@settings(max_examples=200, deadline=None)
@given(tokens=token_lists, cut=st.integers(min_value=0, max_value=200), algo=algos, bs=block_sizes)
def test_prefix_consistency(tokens, cut, algo, bs):
    hasher = BlockHasher(Namespace("model"), block_size=bs, algo=algo)
    full = hasher.hash_blocks(tokens)
    prefix = hasher.hash_blocks(tokens[:cut])
    assert full[: len(prefix)] == prefix
    assert all(len(k) == KEY_BYTES for k in full)


@settings(max_examples=100, deadline=None)
@given(tokens=token_lists, split=st.integers(min_value=0, max_value=20), algo=algos)
def test_extending_a_chain_from_its_parent(tokens, split, algo):
    hasher = BlockHasher(Namespace("model"), block_size=4, algo=algo)
    full = hasher.hash_blocks(tokens)
    head = hasher.hash_blocks(tokens[: split * 4])
    if not head:
        return
    tail = hasher.hash_blocks(tokens[len(head) * 4 :], parent=head[-1])
    assert head + tail == full


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=50_000), min_size=16, max_size=64),
    field=st.sampled_from(["model", "revision", "lora", "tenant", "kv_dtype", "kv_layout"]),
    algo=algos,
)
def test_every_namespace_field_changes_every_key(tokens, field, algo):
    base = Namespace("model", "rev", "lora", "tenant", "f32", "L1")
    changed = dataclasses.replace(base, **{field: getattr(base, field) + "x"})
    a = BlockHasher(base, 16, algo).hash_blocks(tokens)
    b = BlockHasher(changed, 16, algo).hash_blocks(tokens)
    assert a and all(x != y for x, y in zip(a, b, strict=True))


def test_namespace_encoding_is_unambiguous():
    # Without length prefixes these two would concatenate to the same bytes.
    assert Namespace("ab", "c").encode() != Namespace("a", "bc").encode()


def test_algos_differ_and_are_deterministic():
    toks = list(range(64))
    a = BlockHasher(Namespace("m"), 16, HashAlgo.SHA256).hash_blocks(toks)
    b = BlockHasher(Namespace("m"), 16, HashAlgo.XXH3).hash_blocks(toks)
    assert a != b
    assert a == BlockHasher(Namespace("m"), 16, "sha256").hash_blocks(np.array(toks))  # type: ignore[arg-type]


def test_chunk_keys_line_up_with_blocks():
    hasher = BlockHasher(Namespace("m"), block_size=16)
    toks = list(range(1000))
    blocks = hasher.hash_blocks(toks)
    chunks = hasher.chunk_keys(toks, chunk_size=256)
    assert len(chunks) == 3
    assert chunks == [blocks[15], blocks[31], blocks[47]]
    with pytest.raises(ValueError, match="multiple of block_size=16"):
        hasher.chunk_keys(toks, chunk_size=100)


def test_bad_tokens_are_rejected_with_numbers():
    with pytest.raises(ValueError, match=r"\[-1, 3\]"):
        tokens_to_bytes([-1, 3])
    with pytest.raises(ValueError, match="4294967296"):
        tokens_to_bytes([2**32])
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(Namespace("m"), block_size=0)


def test_hex_round_trip():
    key = BlockHasher(Namespace("m"), 1).hash_blocks([1])[0]
    assert key_from_hex(key.hex()) == key
    with pytest.raises(ValueError):
        key_from_hex("abcd")
