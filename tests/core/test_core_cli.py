import asyncio
import json
import subprocess
import sys

from kvmesh.cli import main
from kvmesh.core.event_transport import ZmqEventPublisher
from kvmesh.core.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace
from kvmesh.core.vllm_hashing import to_wire_u64, vllm_block_hashes


def test_hash_command_modes(capsys):
    toks = [str(t) for t in range(40)]
    assert main(["hash", "--block-size", "16", "--model", "m", "--tenant", "t", *toks]) == 0
    expected = BlockHasher(Namespace("m", tenant="t"), 16).hash_blocks(list(range(40)))
    assert capsys.readouterr().out.split() == [k.hex() for k in expected]

    assert main(["hash", "--algo", "xxh3", "--block-size", "16", "--model", "m", *toks]) == 0
    expected = BlockHasher(Namespace("m"), 16, HashAlgo.XXH3).hash_blocks(list(range(40)))
    assert capsys.readouterr().out.split() == [k.hex() for k in expected]

    assert main(["hash", "--algo", "vllm-sha256-cbor", "--seed", "7", "--extra-key", "lora", *toks]) == 0
    expected_u64 = [
        to_wire_u64(h) for h in vllm_block_hashes(list(range(40)), 16, seed="7", extra_keys=["lora"])
    ]
    assert [int(x) for x in capsys.readouterr().out.split()] == expected_u64


# vLLM 0.32's own hashes (Request + get_request_block_hasher, sha256_cbor; PYTHONHASHSEED=0) for
# tokens 100..107, block size 4, LoRA "adapter-a" at "/loras/a", cache_salt "tenant-1".
VLLM_LORA_SALT_SEED0 = [
    "42ded1f84d46bf3808866c5827c7ce94e1db9267d904ff634ac5d8655bfcec3a",
    "385fff69c2287c0a0d559a48fcb844ffe97387cec17f56ffd181c6d7e083c998",
]


def test_hash_command_reproduces_vllm_lora_and_salt(capsys):
    toks = [str(t) for t in range(100, 108)]
    args = ["hash", "--algo", "vllm-sha256-cbor", "--block-size", "4", "--seed", "0", *toks]
    lora = ["--lora", "adapter-a", "--lora-path", "/loras/a", "--cache-salt", "tenant-1"]
    assert main([*args, *lora]) == 0
    assert [int(x) for x in capsys.readouterr().out.split()] == [
        int(h[-16:], 16) for h in VLLM_LORA_SALT_SEED0
    ]
    assert main([*args, *lora, "--format", "hex"]) == 0
    assert capsys.readouterr().out.split() == VLLM_LORA_SALT_SEED0

    # Older vLLM's untagged keys: bare name then salt, no path.
    assert main([*args, "--lora", "adapter-a", "--cache-salt", "tenant-1", "--legacy-extra-keys"]) == 0
    legacy = vllm_block_hashes(
        list(range(100, 108)),
        4,
        seed="0",
        lora_name="adapter-a",
        cache_salt="tenant-1",
        legacy_extra_keys=True,
    )
    assert [int(x) for x in capsys.readouterr().out.split()] == [to_wire_u64(h) for h in legacy]


def test_hash_command_seed_defaults_like_vllm(capsys, monkeypatch):
    toks = [str(t) for t in range(8)]
    args = ["hash", "--algo", "vllm-sha256-cbor", "--block-size", "4", "--format", "hex", *toks]
    monkeypatch.setenv("PYTHONHASHSEED", "")  # set but empty: vLLM hashes the empty string
    assert main(args) == 0
    assert capsys.readouterr().out.split() == [h.hex() for h in vllm_block_hashes(list(range(8)), 4, seed="")]
    monkeypatch.delenv("PYTHONHASHSEED")
    assert main(args) == 0
    expected = vllm_block_hashes(list(range(8)), 4, seed="vllm-none-hash")
    assert capsys.readouterr().out.split() == [h.hex() for h in expected]
    assert main([*args, "--seed", ""]) == 0
    assert capsys.readouterr().out.split() == [h.hex() for h in vllm_block_hashes(list(range(8)), 4, seed="")]


def test_hash_command_refuses_a_lora_without_its_path(capsys):
    toks = [str(t) for t in range(8)]
    assert main(["hash", "--algo", "vllm-sha256-cbor", "--lora", "a", *toks]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--lora-path" in captured.err
    assert main(["hash", "--algo", "vllm-sha256-cbor", "--lora-path", "/p", *toks]) == 2
    assert "needs --lora" in capsys.readouterr().err


def test_events_decode_prints_one_json_object_per_event(tmp_path, capsys):
    good = tmp_path / "good.msgpack"
    good.write_bytes(
        encode_batch([BlockStored([1], None, [1, 2], 2, None, "GPU"), BlockRemoved([1]), AllBlocksCleared()])
    )
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"\xc1garbage")
    assert main(["events", "decode", str(good), str(bad)]) == 1
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [d["type"] for d in lines] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert lines[0]["token_ids"] == [1, 2] and lines[0]["medium"] == "GPU"
    assert "bad.msgpack" in captured.err


async def test_events_listen_over_a_real_socket():
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    try:
        for i in range(3):
            pub.publish([BlockStored([i], None, list(range(16)), 16)])
        await asyncio.sleep(0.1)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvmesh",
            "events",
            "listen",
            f"{pub.endpoint},replay={pub.replay_endpoint}",
            "--count",
            "3",
            "--timeout",
            "20",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = await proc.communicate()
    finally:
        pub.close()
    assert proc.returncode == 0, err.decode()
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert [d["block_hashes"] for d in lines] == [[0], [1], [2]]
