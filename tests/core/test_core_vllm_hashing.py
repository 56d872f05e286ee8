import hashlib

import cbor2

from kvmesh.core.vllm_hashing import (
    block_extra_keys,
    none_hash,
    sha256_cbor,
    to_wire_u64,
    vllm_block_hashes,
)


def test_cbor_encoding_is_canonical_array():
    # (parent, tokens, None) encodes as a CBOR array of 3: 0x83.
    raw = cbor2.dumps((b"\x00" * 32, (1, 2), None), canonical=True)
    assert raw[0] == 0x83
    assert raw.endswith(b"\x82\x01\x02\xf6")


def test_block_hash_recipe_step_by_step():
    seed = "1234"
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    assert none_hash(seed) == parent
    h0 = hashlib.sha256(cbor2.dumps((parent, (1, 2, 3, 4), None), canonical=True)).digest()
    h1 = hashlib.sha256(cbor2.dumps((h0, (5, 6, 7, 8), None), canonical=True)).digest()
    assert vllm_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, seed=seed) == [h0, h1]


def test_extra_keys_lora_and_salt():
    assert block_extra_keys(0, None, None) is None
    assert block_extra_keys(0, "lora-a", "salt") == ("lora-a", "salt")
    assert block_extra_keys(1, "lora-a", "salt") == ("lora-a",)
    assert block_extra_keys(3, None, "salt") is None
    plain = vllm_block_hashes(list(range(8)), 4, seed="0")
    salted = vllm_block_hashes(list(range(8)), 4, seed="0", cache_salt="s")
    assert plain[0] != salted[0] and plain[1] != salted[1]  # the salt propagates through the chain
    parent = none_hash("0")
    assert salted[0] == sha256_cbor((parent, (0, 1, 2, 3), ("s",)))


def test_seed_from_environment(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert none_hash() == sha256_cbor("42")
    monkeypatch.delenv("PYTHONHASHSEED")
    assert none_hash() == sha256_cbor("vllm-none-hash")


def test_wire_value_is_last_8_bytes_big_endian():
    h = bytes(range(32))
    assert to_wire_u64(h) == int.from_bytes(bytes(range(24, 32)), "big")
