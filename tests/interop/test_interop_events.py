"""Interop with a real vLLM: its decoder, encoder and ZMQ publisher run in vLLM's own virtualenv.

vLLM is installed in a separate venv (``.venv-vllm`` at the repository root) because its
dependencies clash with ours, so every check here runs vLLM in a subprocess with that interpreter
and exchanges bytes through files or ZMQ ``ipc://`` sockets in a private temporary directory. vLLM's
publisher binds only wildcard, ``::`` and ``ipc://``/``inproc://`` endpoints, hence ``ipc://``.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import random
import shutil
import subprocess
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from kvmesh.core.event_transport import ZmqEventPublisher, ZmqEventSubscriber
from kvmesh.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from kvmesh.core.types import PodId
from kvmesh.fleet.vllm import vllm_python

VLLM_PYTHON = vllm_python()

# vLLM's real decoder and publisher run in its own virtualenv; without it these fail (conftest).
pytestmark = [pytest.mark.usefixtures("vllm_available"), pytest.mark.timeout(300)]

# Executed both here (with kvmesh's structs) and in the vLLM subprocess (with vLLM's), so both sides
# build the same events from the same positional arguments, in vLLM's field order.
SHARED_SRC = textwrap.dedent(
    """
    import msgspec

    def make_events(i, BlockStored, BlockRemoved, AllBlocksCleared):
        evs = [
            BlockStored([i * 10 + 1, i * 10 + 2], None if i == 0 else i * 10 - 8, list(range(32)), 16,
                        None, "GPU", None),
            BlockStored([bytes([i]) * 32], i * 10 + 2, list(range(16)), 16, 7, "CPU", "lora-a",
                        [("lora-a", ("mm", "img", 3))], 1, "sliding_window", 4096, "LOCAL", "tier-2",
                        f"session-{i}"),
            BlockRemoved([i * 10], "GPU"),
            BlockRemoved([2**64 - 1 - i], "CPU", 1, "REMOTE", "tier-2"),
        ]
        if i % 3 == 2:
            evs.append(AllBlocksCleared())
        return evs

    def normal(ev):
        # Class-independent form: tuples become lists, bytes base64, as JSON would carry them.
        d = {"type": type(ev).__name__, **msgspec.structs.asdict(ev)}
        return msgspec.json.decode(msgspec.json.encode(d))
    """
)
_shared: dict[str, Any] = {}
exec(SHARED_SRC, _shared)
normal = _shared["normal"]


def make_events(i: int) -> list[Any]:
    return _shared["make_events"](i, BlockStored, BlockRemoved, AllBlocksCleared)


VLLM_PRELUDE = SHARED_SRC + textwrap.dedent(
    """
    import json, sys, time
    from vllm.distributed.kv_events import (
        AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher,
    )
    """
)


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    # A short path: unix socket paths are limited to ~107 bytes, pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="kvm-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def vllm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    return env


def open_log(path: Path) -> IO[str]:
    return open(path, "w")


async def wait_until(pred: Callable[[], bool], deadline: float) -> None:
    while not pred():
        if time.monotonic() > deadline:
            return  # the caller's assertions say what was missing
        await asyncio.sleep(0.05)


def run_vllm(script: str, *args: str, timeout: float = 240) -> str:
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_PRELUDE + textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=vllm_env(),
    )
    assert proc.returncode == 0, f"vLLM subprocess failed:\n{proc.stderr[-4000:]}"
    return proc.stdout


def random_events(rng: random.Random, n: int) -> list[Any]:
    """Events with every optional field randomly set or nil, hashes as ints or bytes."""

    def h() -> int | bytes:
        return rng.getrandbits(64) if rng.random() < 0.7 else rng.randbytes(32)

    def maybe(value: Any) -> Any:
        return value if rng.random() < 0.5 else None

    out: list[Any] = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.6:
            nb = rng.randint(1, 4)
            out.append(
                BlockStored(
                    [h() for _ in range(nb)],
                    maybe(h()),
                    [rng.randrange(2**17) for _ in range(nb * 16)],
                    16,
                    maybe(rng.randrange(100)),
                    maybe(rng.choice(["GPU", "CPU", "STORAGE"])),
                    maybe("lora-x"),
                    maybe([maybe(["lora-x", ["mm", "id", rng.randrange(9)]]) for _ in range(nb)]),
                    maybe(rng.randrange(4)),
                    maybe(rng.choice(["full_attention", "sliding_window", "mamba", "mla_attention"])),
                    maybe(rng.choice([128, 4096])),
                    maybe(rng.choice(["LOCAL", "REMOTE"])),
                    maybe("tier-2"),
                    maybe(f"s{rng.randrange(99)}"),
                )
            )
        elif kind < 0.95:
            out.append(
                BlockRemoved(
                    [h() for _ in range(rng.randint(1, 4))],
                    maybe("CPU"),
                    maybe(rng.randrange(4)),
                    maybe("LOCAL"),
                    maybe("tier-2"),
                )
            )
        else:
            out.append(AllBlocksCleared())
    return out


def test_vllm_decodes_our_encoding_and_we_decode_vllms(tmp_path):
    rng = random.Random(7)
    batches: list[KVEventBatch] = [
        KVEventBatch(i + 0.5, make_events(i), None if i % 2 else i) for i in range(4)
    ]
    batches += [KVEventBatch(float(i), random_events(rng, 20), rng.choice([None, 3])) for i in range(30)]
    batches.append(KVEventBatch(99.0, [], None))
    for n, batch in enumerate(batches):
        (tmp_path / f"ours-{n}.bin").write_bytes(
            encode_batch(batch.events, batch.ts, batch.data_parallel_rank)
        )
    out = run_vllm(
        """
        d = sys.argv[1]
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        enc = msgspec.msgpack.Encoder()
        report = []
        for n in range(int(sys.argv[2])):
            raw = open(f"{d}/ours-{n}.bin", "rb").read()
            batch = dec.decode(raw)
            report.append({
                "ts": batch.ts,
                "dp": batch.data_parallel_rank,
                "events": [normal(e) for e in batch.events],
                "reencoded_identical": enc.encode(batch) == raw,
            })
        for i in range(4):
            batch = KVEventBatch(ts=i + 0.25, events=make_events(i, BlockStored, BlockRemoved, AllBlocksCleared))
            open(f"{d}/vllm-{i}.bin", "wb").write(enc.encode(batch))
        print(json.dumps(report))
        """,
        str(tmp_path),
        str(len(batches)),
    )
    report = json.loads(out.strip().splitlines()[-1])
    assert len(report) == len(batches)
    for batch, seen in zip(batches, report, strict=True):
        assert seen["ts"] == batch.ts and seen["dp"] == batch.data_parallel_rank
        assert seen["events"] == [normal(e) for e in batch.events]
        # Same bytes as vLLM's own encoder writes for the decoded batch.
        assert seen["reencoded_identical"]
    for i in range(4):
        raw = (tmp_path / f"vllm-{i}.bin").read_bytes()
        ours = decode_batch(raw)
        assert ours.ts == i + 0.25 and ours.data_parallel_rank is None
        assert [normal(e) for e in ours.events] == [normal(e) for e in make_events(i)]
        assert encode_batch(make_events(i), i + 0.25) == raw


VLLM_PUBLISHER = """
pub = ZmqEventPublisher(0, endpoint=sys.argv[1], replay_endpoint=sys.argv[2], topic="kv@vllm")
n = 0
def publish():
    global n
    pub.publish(KVEventBatch(ts=float(n), events=make_events(n, BlockStored, BlockRemoved, AllBlocksCleared)))
    n += 1
for _ in range(3):
    publish()
time.sleep(0.5)
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "more":
        break
    publish()
pub.shutdown()
"""


async def test_our_subscriber_replays_and_follows_vllms_publisher(ipc_dir):
    pub_ep, replay_ep = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"
    with open_log(ipc_dir / "stderr.txt") as errf:
        proc = await asyncio.create_subprocess_exec(
            str(VLLM_PYTHON),
            "-c",
            VLLM_PRELUDE + VLLM_PUBLISHER,
            pub_ep,
            replay_ep,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errf,
            env=vllm_env(),
        )
    assert proc.stdin is not None and proc.stdout is not None
    got: list[tuple[int, KVEventBatch]] = []
    resets: list[PodId] = []
    sub = ZmqEventSubscriber(lambda pod, seq, batch: got.append((seq, batch)), resets.append, topic="kv@")
    task: asyncio.Task[None] | None = None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 240)
        assert line.strip() == b"ready", (ipc_dir / "stderr.txt").read_text()[-4000:]
        sub.add_publisher(PodId("vllm"), pub_ep, replay_ep)
        task = asyncio.create_task(sub.run())
        deadline = time.monotonic() + 30
        await wait_until(lambda: len(got) >= 3, deadline)
        assert [seq for seq, _ in got] == [0, 1, 2]  # the history, through vLLM's 4-frame replay
        assert sub.stats.num_replayed == 3
        # Live batches; any the SUB socket misses before it has joined come back through replay.
        while len(got) < 6 and time.monotonic() < deadline:
            proc.stdin.write(b"more\n")
            await proc.stdin.drain()
            await asyncio.sleep(0.1)
        seqs = [seq for seq, _ in got]
        assert len(seqs) >= 6 and seqs == list(range(len(seqs)))
        for seq, batch in got:
            assert batch.ts == float(seq) and batch.data_parallel_rank == 0
            assert [normal(e) for e in batch.events] == [normal(e) for e in make_events(seq)]
        assert sub.stats.num_malformed == 0 and sub.stats.num_resets == 0 and not resets
    finally:
        await sub.aclose()
        if task is not None:
            await task
        if proc.returncode is None:
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


VLLM_SUBSCRIBER = """
import zmq
END = ZmqEventPublisher.END_SEQ
dec = msgspec.msgpack.Decoder(KVEventBatch)
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
dealer = ctx.socket(zmq.DEALER)
dealer.connect(sys.argv[2])
dealer.send_multipart([b"", (0).to_bytes(8, "big")])
replayed = []
while True:
    assert dealer.poll(30_000), "no replay answer"
    frames = dealer.recv_multipart()
    # vLLM's publisher answers [b"", topic, seq, payload] and ends with [b"", b"", END, b""].
    assert len(frames) == 4 and frames[0] == b"", frames
    _, topic, seq, payload = frames
    if seq == END:
        assert topic == b"" and payload == b""
        break
    batch = dec.decode(payload)
    replayed.append({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"),
                     "dp": batch.data_parallel_rank, "events": [normal(e) for e in batch.events]})
print("REPLAY " + json.dumps(replayed), flush=True)
assert sub.poll(60_000), "no live batch"
topic, seq, payload = sub.recv_multipart()
batch = dec.decode(payload)
print("LIVE " + json.dumps({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"),
                            "events": [normal(e) for e in batch.events]}), flush=True)
"""


def test_vllm_style_subscriber_replays_and_follows_our_publisher(ipc_dir):
    pub = ZmqEventPublisher(
        f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay", topic="kv@kvmesh", data_parallel_rank=1
    )
    proc: subprocess.Popen[str] | None = None
    lines: queue.Queue[str] = queue.Queue()
    try:
        for i in range(3):
            pub.publish(make_events(i))
        deadline = time.monotonic() + 10
        while pub.num_published < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.endpoint and pub.replay_endpoint
        with open(ipc_dir / "stderr.txt", "w") as errf:
            proc = subprocess.Popen(
                [str(VLLM_PYTHON), "-c", VLLM_PRELUDE + VLLM_SUBSCRIBER, pub.endpoint, pub.replay_endpoint],
                stdout=subprocess.PIPE,
                stderr=errf,
                text=True,
                env=vllm_env(),
            )
        stdout = proc.stdout
        assert stdout is not None

        def read_lines() -> None:
            for line in stdout:
                lines.put(line)
            lines.put("EOF ")  # the subprocess exited: fail now rather than at a timeout

        threading.Thread(target=read_lines, daemon=True).start()

        def next_line(timeout: float) -> str:
            try:
                return lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError((ipc_dir / "stderr.txt").read_text()[-4000:]) from None

        kind, _, body = next_line(240).partition(" ")
        assert kind == "REPLAY", (ipc_dir / "stderr.txt").read_text()[-4000:]
        replayed = json.loads(body)
        assert [r["seq"] for r in replayed] == [0, 1, 2]
        for r in replayed:
            assert r["topic"] == "kv@kvmesh" and r["dp"] == 1
            assert r["events"] == [normal(e) for e in make_events(r["seq"])]
        # Publish live until vLLM's SUB socket, which joined while replaying, reports one.
        live = None
        for i in range(3, 300):
            pub.publish(make_events(i))
            try:
                live = lines.get(timeout=0.1)
                break
            except queue.Empty:
                continue
        assert live is not None and live.startswith("LIVE "), (ipc_dir / "stderr.txt").read_text()[-4000:]
        seen = json.loads(live.partition(" ")[2])
        assert seen["topic"] == "kv@kvmesh" and seen["seq"] >= 3
        assert seen["events"] == [normal(e) for e in make_events(seen["seq"])]
        assert proc.wait(30) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        pub.close()
