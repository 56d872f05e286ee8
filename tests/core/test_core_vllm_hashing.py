"""kvmesh.core.vllm_hashing: vLLM's sha256_cbor block hashes, checked against vLLM's own code.

The golden-parity test runs vLLM 0.32 (``.venv-vllm``, or ``$KVMESH_VLLM_PYTHON``) in a subprocess:
a real ``vllm.v1.request.Request`` with vLLM's ``get_request_block_hasher`` (so
``generate_block_hash_extra_keys`` → ``hash_block_tokens``), ``init_none_hash(sha256_cbor)`` under
each PYTHONHASHSEED case, ``to_event_extra_keys`` and ``maybe_convert_block_hash`` in both wire modes.
The pinned vectors below come from that run and keep the fast tests honest without vLLM.
"""

import hashlib
import json
import os
import subprocess
from pathlib import Path

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.vllm_hashing import (
    DEFAULT_NONE_HASH_SEED,
    block_extra_keys,
    event_extra_key,
    hash_block,
    lora_extra_key,
    none_hash,
    resolve_seed,
    sha256_cbor,
    to_event_extra_keys,
    to_wire,
    to_wire_u64,
    vllm_block_hashes,
)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVMESH_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

TOKENS_8 = list(range(100, 108))
LORA = ("adapter-a", "/loras/a")

# Computed by vLLM 0.32 (Request + get_request_block_hasher, sha256_cbor), block_size 4, TOKENS_8.
PINNED = {
    "plain": (
        None,
        None,
        None,
        [
            "f6660814c0f5fab668e3a3e4cc9d7c843f32e254d6a433791cccfba573d0cf8a",
            "da25ae2ea37cfe14f808bf230a0ad0c2bca0e7a731e7f54cf20358aa4fbb8879",
        ],
    ),
    "lora": (
        None,
        LORA,
        None,
        [
            "2e95c4f577faa78b28682dc1a99fd79585ff5d6c2a4b620cba3a14dc870237f3",
            "1c8ead53fae5986c30cb0eae01aeb3431080cadf1c553a0b753a860b6015513f",
        ],
    ),
    "salt": (
        None,
        None,
        "tenant-1",
        [
            "f3cab1cf204e625404216d3357678f51b0e6c26e7f0888a000a9d877d985fce7",
            "aab4ceae3e110a32aece8636507e1bc982bd34fcee04c62a87e652534a485841",
        ],
    ),
    "lora_salt_seed0": (
        "0",
        LORA,
        "tenant-1",
        [
            "42ded1f84d46bf3808866c5827c7ce94e1db9267d904ff634ac5d8655bfcec3a",
            "385fff69c2287c0a0d559a48fcb844ffe97387cec17f56ffd181c6d7e083c998",
        ],
    ),
    "plain_seed_empty": (
        "",
        None,
        None,
        [
            "29b5637dbb8d54a8997cc1bb67af1c127f9e6060fe62bfcae31708ae22814b8e",
            "5455381cad9f99920c92d06ed75422d542bb248ec461487a47b7559d55835b38",
        ],
    ),
}


def _set_seed_env(monkeypatch, seed_env):
    if seed_env is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed_env)


# ---------------------------------------------------------------- recipe, step by step (no vLLM)


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
    assert hash_block(parent, [1, 2, 3, 4]) == h0


@pytest.mark.parametrize("case", sorted(PINNED))
def test_pinned_vllm_vectors(monkeypatch, case):
    seed_env, lora, salt, expected = PINNED[case]
    _set_seed_env(monkeypatch, seed_env)
    name, path = lora or (None, None)
    got = vllm_block_hashes(TOKENS_8, 4, lora_name=name, lora_path=path, cache_salt=salt)
    assert [h.hex() for h in got] == expected
    # The same with the seed given explicitly instead of through the environment.
    monkeypatch.setenv("PYTHONHASHSEED", "not-this-one")
    explicit = DEFAULT_NONE_HASH_SEED if seed_env is None else seed_env
    assert (
        vllm_block_hashes(TOKENS_8, 4, seed=explicit, lora_name=name, lora_path=path, cache_salt=salt) == got
    )


def test_tagged_extra_keys():
    assert block_extra_keys(0, None, None) is None
    assert block_extra_keys(0, "a", "s", lora_path="/p") == (("lora", "a", "/p"), ("cache_salt", "s"))
    assert block_extra_keys(1, "a", "s", lora_path="/p") == (("lora", "a", "/p"),)
    assert block_extra_keys(0, None, "s") == (("cache_salt", "s"),)
    assert block_extra_keys(3, None, "s") is None
    assert block_extra_keys(0, None, "") is None  # an empty salt is no salt, as in vLLM
    parent = none_hash("0")
    salted = vllm_block_hashes(list(range(8)), 4, seed="0", cache_salt="s")
    assert salted[0] == sha256_cbor((parent, (0, 1, 2, 3), (("cache_salt", "s"),)))
    assert salted[1] == sha256_cbor((salted[0], (4, 5, 6, 7), None))
    plain = vllm_block_hashes(list(range(8)), 4, seed="0")
    assert plain[0] != salted[0] and plain[1] != salted[1]  # the salt propagates through the chain


def test_legacy_untagged_extra_keys():
    assert block_extra_keys(0, "lora-a", "salt", legacy_extra_keys=True) == ("lora-a", "salt")
    assert block_extra_keys(1, "lora-a", "salt", legacy_extra_keys=True) == ("lora-a",)
    assert block_extra_keys(3, None, "salt", legacy_extra_keys=True) is None
    parent = none_hash("0")
    legacy = vllm_block_hashes(
        list(range(8)), 4, seed="0", lora_name="a", cache_salt="s", legacy_extra_keys=True
    )
    assert legacy[0] == sha256_cbor((parent, (0, 1, 2, 3), ("a", "s")))
    assert legacy[1] == sha256_cbor((legacy[0], (4, 5, 6, 7), ("a",)))
    tagged = vllm_block_hashes(list(range(8)), 4, seed="0", lora_name="a", lora_path="/p", cache_salt="s")
    assert tagged[0] != legacy[0]


def test_lora_without_path_is_refused_in_the_tagged_recipe():
    with pytest.raises(ValueError, match="lora_path"):
        vllm_block_hashes(list(range(8)), 4, lora_name="a")
    with pytest.raises(ValueError, match="lora_path"):
        lora_extra_key("a", "")
    # Explicit extra keys need no path; the legacy recipe has none.
    assert vllm_block_hashes(list(range(8)), 4, seed="0", lora_name="a", extra_keys=["a"])
    assert vllm_block_hashes(list(range(8)), 4, seed="0", lora_name="a", legacy_extra_keys=True)


def test_lora_path_is_part_of_the_hash():
    a = vllm_block_hashes(list(range(8)), 4, seed="0", lora_name="a", lora_path="/v1")
    b = vllm_block_hashes(list(range(8)), 4, seed="0", lora_name="a", lora_path="/v2")
    assert a[0] != b[0] and a[1] != b[1]


def test_seed_resolution(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert none_hash() == sha256_cbor("42")
    monkeypatch.setenv("PYTHONHASHSEED", "")  # set but empty: the empty string is the seed
    assert resolve_seed() == ""
    assert none_hash() == sha256_cbor("") != sha256_cbor(DEFAULT_NONE_HASH_SEED)
    monkeypatch.delenv("PYTHONHASHSEED")
    assert none_hash() == sha256_cbor("vllm-none-hash")
    assert resolve_seed("", {}) == "" and resolve_seed("7", {"PYTHONHASHSEED": "8"}) == "7"
    assert resolve_seed(None, {"PYTHONHASHSEED": ""}) == ""
    assert resolve_seed(None, {}) == DEFAULT_NONE_HASH_SEED


def test_event_extra_keys():
    tagged = [block_extra_keys(i, "a", "s", lora_path="/p") for i in range(3)] + [None]
    assert to_event_extra_keys(tagged) == [("a", "s"), ("a",), ("a",), None]
    assert to_event_extra_keys([]) is None and to_event_extra_keys(None) is None
    assert to_event_extra_keys([None]) == [None]
    assert event_extra_key(("mm", "hash", 3)) == ("hash", 3)
    assert event_extra_key(("prompt_embeds", b"\x01")) == b"\x01"
    with pytest.raises(ValueError):
        event_extra_key("a")  # a legacy bare key is not tagged


def test_wire_forms():
    h = bytes(range(32))
    assert to_wire_u64(h) == int.from_bytes(bytes(range(24, 32)), "big")
    assert to_wire(h) == to_wire_u64(h) and to_wire(h, use_int_block_hashes=False) == h


# ---------------------------------------------------------------- properties (no vLLM)

_names = st.text(min_size=0, max_size=12)
_tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    tokens=_tokens,
    block_size=st.integers(min_value=1, max_value=8),
    seed=_names,
    lora=st.none() | st.tuples(_names, st.text(min_size=1, max_size=12)),
    salt=st.none() | _names,
)
def test_chain_matches_recipe_and_is_prefix_stable(tokens, block_size, seed, lora, salt):
    name, path = lora or (None, None)
    hashes = vllm_block_hashes(tokens, block_size, seed=seed, lora_name=name, lora_path=path, cache_salt=salt)
    assert len(hashes) == len(tokens) // block_size
    parent = sha256_cbor(seed)
    for i, h in enumerate(hashes):
        keys = [("lora", name, path)] if name is not None else []
        if salt and i == 0:
            keys.append(("cache_salt", salt))
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(cbor2.dumps((parent, block, tuple(keys) or None), canonical=True)).digest()
        assert h == parent
    prefix = tokens[: len(tokens) // 2]
    assert (
        vllm_block_hashes(prefix, block_size, seed=seed, lora_name=name, lora_path=path, cache_salt=salt)
        == hashes[: len(prefix) // block_size]
    )


@settings(max_examples=150, deadline=None)
@given(n=st.integers(min_value=1, max_value=5), lora=st.none() | _names, salt=st.none() | _names)
def test_event_form_of_tagged_keys_is_the_legacy_form(n, lora, salt):
    # vLLM publishes untagged keys in the pre-tagging shape: exactly the legacy keys.
    tagged = [block_extra_keys(i, lora, salt, lora_path="/p") for i in range(n)]
    legacy = [block_extra_keys(i, lora, salt, legacy_extra_keys=True) for i in range(n)]
    assert to_event_extra_keys(tagged) == legacy


@settings(max_examples=200, deadline=None)
@given(h=st.binary(min_size=32, max_size=32))
def test_wire_u64_is_the_last_8_bytes(h):
    assert to_wire_u64(h) == int.from_bytes(h[-8:], "big") < 2**64


# ---------------------------------------------------------------- golden parity with vLLM itself

# Runs under vLLM's interpreter. Each case either builds a real vLLM Request whose block hasher is
# vLLM's (extra keys from generate_block_hash_extra_keys), or chains hash_block_tokens over explicit
# per-block keys (for recipes vLLM 0.32 no longer generates). A case without "seed_env" keeps the
# PYTHONHASHSEED the process was started with.
_VLLM_GOLDEN = r"""
import json, os, sys
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.request import Request

out = {}
for i, case in enumerate(json.load(sys.stdin)):
    if "seed_env" in case:
        if case["seed_env"] is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = case["seed_env"]
    kcu.init_none_hash(sha256_cbor)
    tokens, bs = case["tokens"], case["block_size"]
    if case.get("vllm_block_keys") is not None:
        parent, hashes, extras = None, [], []
        for b, keys in enumerate(case["vllm_block_keys"]):
            keys = None if keys is None else tuple(keys)
            parent = kcu.hash_block_tokens(sha256_cbor, parent, tokens[b * bs : (b + 1) * bs], keys)
            hashes.append(parent)
            extras.append(keys)
    else:
        lora = None
        if case.get("lora_name") is not None:
            lora = LoRARequest(case["lora_name"], 1, case["lora_path"])
        req = Request(
            f"req-{i}", tokens, SamplingParams(max_tokens=1), None,
            lora_request=lora, cache_salt=case.get("cache_salt"),
            block_hasher=kcu.get_request_block_hasher(bs, sha256_cbor),
        )
        hashes = list(req.block_hashes)
        extras = [
            kcu.generate_block_hash_extra_keys(req, b * bs, (b + 1) * bs, 0)[0]
            for b in range(len(hashes))
        ]
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
    wire_int = [kcu.maybe_convert_block_hash(h) for h in hashes]
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
    wire_raw = [kcu.maybe_convert_block_hash(h).hex() for h in hashes]
    out[case["id"]] = {
        "seed": kcu.get_none_hash_seed(),
        "none_hash": kcu.NONE_HASH.hex(),
        "hashes": [h.hex() for h in hashes],
        "wire_int": wire_int,
        "wire_raw": wire_raw,
        "extra_keys": extras,
        "event_extra_keys": (
            None if case.get("vllm_block_keys") is not None else kcu.to_event_extra_keys(extras)
        ),
    }
json.dump(out, sys.stdout)
"""

_LONG = [0, 1, 2**16, 2**31 - 1, 2**32 - 1, *range(151_000, 151_035)]  # 40 tokens, 2 full blocks of 16

# seed_env: absent = the PYTHONHASHSEED vLLM was started with (""), None = unset, else its value.
# ours: kwargs for vllm_block_hashes besides tokens/block_size.
GOLDEN_CASES = [
    {"id": "process_env_empty_seed", "tokens": TOKENS_8, "block_size": 4, "env": ""},
    *(
        {
            "id": case,
            "seed_env": seed_env,
            "env": seed_env,
            "tokens": TOKENS_8,
            "block_size": 4,
            "lora_name": (lora or (None, None))[0],
            "lora_path": (lora or (None, None))[1],
            "cache_salt": salt,
        }
        for case, (seed_env, lora, salt, _) in PINNED.items()
    ),
    {"id": "plain_seed0", "seed_env": "0", "env": "0", "tokens": _LONG, "block_size": 16},
    {
        "id": "lora_seed_empty",
        "seed_env": "",
        "env": "",
        "tokens": _LONG,
        "block_size": 16,
        "lora_name": "sql-lora",
        "lora_path": "/models/loras/sql",
    },
    {
        "id": "salt_unicode_unset",
        "seed_env": None,
        "env": None,
        "tokens": _LONG,
        "block_size": 16,
        "cache_salt": "tenant-é✓",
    },
    {
        "id": "lora_salt_unset",
        "seed_env": None,
        "env": None,
        "tokens": _LONG,
        "block_size": 16,
        "lora_name": "sql-lora",
        "lora_path": "/models/loras/sql",
        "cache_salt": "s3cr3t",
    },
    {
        "id": "lora_salt_seed_empty",
        "seed_env": "",
        "env": "",
        "tokens": _LONG,
        "block_size": 16,
        "lora_name": "sql-lora",
        "lora_path": "/models/loras/sql",
        "cache_salt": "s3cr3t",
    },
    {
        "id": "lora_salt_block1",
        "seed_env": "0",
        "env": "0",
        "tokens": TOKENS_8,
        "block_size": 1,
        "lora_name": "a",
        "lora_path": "/p",
        "cache_salt": "s",
    },
    # Older vLLM's untagged keys, through vLLM's hash_block_tokens.
    {
        "id": "legacy_lora_salt",
        "seed_env": "0",
        "env": "0",
        "tokens": TOKENS_8,
        "block_size": 4,
        "lora_name": "a",
        "cache_salt": "s",
        "legacy": True,
        "vllm_block_keys": [["a", "s"], ["a"]],
    },
    # `kvmesh hash --extra-key x`: the same explicit keys on every block.
    {
        "id": "explicit_keys",
        "seed_env": "7",
        "env": "7",
        "tokens": TOKENS_8,
        "block_size": 4,
        "extra_keys": ["x", "y"],
        "vllm_block_keys": [["x", "y"], ["x", "y"]],
    },
]


@pytest.fixture(scope="module")
def vllm_golden(tmp_path_factory):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM parity needs vLLM's interpreter at {VLLM_PYTHON} (set KVMESH_VLLM_PYTHON)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    env.update(PYTHONHASHSEED="", VLLM_LOGGING_LEVEL="ERROR")
    cases = [{k: v for k, v in c.items() if k not in ("env", "legacy", "extra_keys")} for c in GOLDEN_CASES]
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", _VLLM_GOLDEN],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path_factory.mktemp("vllm-golden"),
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _json(value):
    return json.loads(json.dumps(value))


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=[c["id"] for c in GOLDEN_CASES])
def test_golden_parity_with_vllm(vllm_golden, monkeypatch, case):
    golden = vllm_golden[case["id"]]
    _set_seed_env(monkeypatch, case["env"])
    assert resolve_seed() == golden["seed"]
    assert none_hash().hex() == golden["none_hash"]

    legacy = case.get("legacy", False)
    kwargs = {
        "lora_name": case.get("lora_name"),
        "lora_path": case.get("lora_path"),
        "cache_salt": case.get("cache_salt"),
        "extra_keys": case.get("extra_keys"),
        "legacy_extra_keys": legacy,
    }
    hashes = vllm_block_hashes(case["tokens"], case["block_size"], **kwargs)
    assert len(hashes) == len(golden["hashes"]) > 0
    assert [h.hex() for h in hashes] == golden["hashes"]
    assert [to_wire_u64(h) for h in hashes] == golden["wire_int"]
    assert [to_wire(h) for h in hashes] == golden["wire_int"]
    assert [to_wire(h, use_int_block_hashes=False).hex() for h in hashes] == golden["wire_raw"]
    if case["id"] in PINNED:
        assert golden["hashes"] == PINNED[case["id"]][3]  # the pinned vectors are still vLLM's

    if case.get("extra_keys") is None:
        ours_keys = [
            block_extra_keys(
                i,
                kwargs["lora_name"],
                kwargs["cache_salt"],
                lora_path=kwargs["lora_path"],
                legacy_extra_keys=legacy,
            )
            for i in range(len(hashes))
        ]
        assert _json(ours_keys) == golden["extra_keys"]
        if not legacy:
            assert _json(to_event_extra_keys(ours_keys)) == golden["event_extra_keys"]
