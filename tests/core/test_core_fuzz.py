"""≥100k random and mutated frames: nothing escapes, every bad frame is counted."""

import random

import msgspec

from kvmesh.core.event_transport import ZmqEventSubscriber
from kvmesh.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    decode_batch,
    encode_batch,
)
from kvmesh.core.types import PodId
from kvmesh.errors import ProtocolError

N_FRAMES = 100_000


def valid_payloads(rng: random.Random) -> list[bytes]:
    out = []
    for i in range(200):
        evs: list[KVEvent] = [
            BlockStored(
                [rng.getrandbits(64)],
                rng.choice([None, rng.getrandbits(64)]),
                list(range(16)),
                16,
                None,
                "GPU",
            ),
            BlockRemoved([rng.randbytes(8)], "CPU", rng.choice([None, 0]), rng.choice([None, "LOCAL"])),
            AllBlocksCleared(),
            BlockStored(
                [rng.getrandbits(64), rng.getrandbits(64)],
                None,
                list(range(32)),
                16,
                None,
                None,
                "lora",
                [["lora"], None],
                1,
                rng.choice(["full_attention", "sliding_window", "mamba"]),
                rng.choice([None, 4096]),
                "REMOTE",
                "tier-2",
                "session",
            ),
        ]
        chosen = evs[: 1 + i % 4]
        out.append(encode_batch(chosen, float(i), rng.choice([None, 1])))
        # Older positional form, and the map-form batch, with and without nil trailing fields.
        positional = [[type(ev).__name__, *msgspec.structs.astuple(ev)] for ev in chosen]
        out.append(msgspec.msgpack.encode([float(i), positional]))
        out.append(
            msgspec.msgpack.encode(
                {"ts": float(i), "events": [{"type": "BlockRemoved", "block_hashes": [i]}]}
            )
        )
        out.append(msgspec.msgpack.encode({"ts": float(i), "events": chosen}))
    return out


def mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    match rng.randrange(5):
        case 0:
            for _ in range(rng.randint(1, 4)):
                if buf:
                    buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        case 1:
            del buf[rng.randrange(len(buf) + 1) :]
        case 2:
            pos = rng.randrange(len(buf) + 1)
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        case 3:
            return rng.randbytes(rng.randint(0, 64))
        case 4:
            if buf:
                buf[rng.randrange(len(buf))] = rng.choice([0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF, 0x00])
    return bytes(buf)


def test_decoder_survives_random_and_mutated_frames():
    rng = random.Random(1234)
    seeds = valid_payloads(rng)
    ok = bad = 0
    for _ in range(N_FRAMES):
        payload = mutate(rng, rng.choice(seeds))
        try:
            decode_batch(payload)
            ok += 1
        except ProtocolError:
            bad += 1
    assert ok + bad == N_FRAMES
    assert bad > N_FRAMES // 4 and ok > 0


async def test_subscriber_counts_every_bad_frame_and_never_raises():
    rng = random.Random(99)
    seeds = valid_payloads(rng)
    delivered: list[int] = []
    sub = ZmqEventSubscriber(lambda pod, seq, batch: delivered.append(seq))
    sub.add_publisher(PodId("fuzz"), "tcp://127.0.0.1:1")  # never connects; frames are fed directly
    expected_bad = 0
    seq = 0
    for _ in range(N_FRAMES):
        kind = rng.randrange(10)
        if kind == 0:  # wrong frame count
            frames = [b"topic"] * rng.choice([0, 1, 2, 4])
            expected_bad += 1
        elif kind == 1:  # bad seq frame
            frames = [b"topic", rng.randbytes(rng.choice([0, 4, 7, 9])), rng.choice(seeds)]
            expected_bad += 1
        else:
            payload = rng.choice(seeds) if kind < 6 else mutate(rng, rng.choice(seeds))
            try:
                decode_batch(payload)
            except ProtocolError:
                expected_bad += 1
            frames = [b"topic", seq.to_bytes(8, "big"), payload]
            seq += 1
        await sub.handle_frames(PodId("fuzz"), frames)
    stats = sub.stats
    assert stats.num_malformed == expected_bad
    assert stats.num_batches + stats.num_malformed == N_FRAMES
    assert len(delivered) == stats.num_batches
    assert stats.num_gaps == 0 and stats.num_resets == 0
    await sub.aclose()
