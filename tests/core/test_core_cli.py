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
