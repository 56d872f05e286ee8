"""Fuzzed KV event frames on the running router's subscriber.

A ZMQ PUB socket of the harness is registered with the router as the events endpoint of a pod that
does not answer HTTP (so no request is ever routed to it). It publishes generated frames: wrong
frame counts, bad seq frames, random bytes, truncated and bit-flipped batches, msgpack of the wrong
shape, events with wrong types or impossible sizes, and seqs that jump and go backwards. Then one
valid batch, which the router must still index.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Iterator

import msgspec
import zmq
import zmq.asyncio

from kvmesh.chaos.bounds import ScenarioResult
from kvmesh.chaos.context import ChaosContext, poll_until
from kvmesh.chaos.load import num_failed, ttft_quantile
from kvmesh.core.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from kvmesh.core.net import free_ports
from kvmesh.core.types import ExternalBlockHash
from kvmesh.fleet.config import HOST

BLOCK_SIZE = 16
DIGEST_TIMEOUT_S = 300.0
_SEND_BURST = 200
"""Frames sent back to back before yielding (keeps the PUB queue under its high-water mark)."""

Frames = list[bytes]


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def _valid_payload(rng: random.Random, vocab: int) -> bytes:
    n_blocks = rng.randint(1, 4)
    tokens = [rng.randrange(vocab) for _ in range(n_blocks * BLOCK_SIZE)]
    hashes: list[ExternalBlockHash] = [rng.getrandbits(64) for _ in range(n_blocks)]
    return encode_batch([BlockStored(hashes, None, tokens, BLOCK_SIZE)], ts=0.0)


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kinds: list[Callable[[], object]] = [
        lambda: rng.randint(-(2**63), 2**64 - 1),
        lambda: rng.random() * 1e308,
        lambda: rng.randbytes(rng.randint(0, 40)),
        lambda: "".join(chr(rng.randint(0, 0x2FFF)) for _ in range(rng.randint(0, 12))),
        lambda: None,
        lambda: rng.choice([True, False]),
    ]
    if depth < 3:
        kinds.append(lambda: [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))])
        kinds.append(lambda: {str(k): _random_value(rng, depth + 1) for k in range(rng.randint(0, 4))})
    return rng.choice(kinds)()


def _bad_event(rng: random.Random, vocab: int) -> dict[str, object]:
    """A BlockStored/BlockRemoved map with one field of a wrong type or an impossible size."""
    event: dict[str, object] = {
        "type": rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Nope", 7]),
        "block_hashes": [rng.getrandbits(64)],
        "parent_block_hash": None,
        "token_ids": [rng.randrange(vocab) for _ in range(BLOCK_SIZE)],
        "block_size": BLOCK_SIZE,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    field = rng.choice(list(event))
    event[field] = rng.choice(
        [
            _random_value(rng),
            -1,
            0,
            2**64 - 1,
            -(2**63),
            [-5] * BLOCK_SIZE,
            list(range(BLOCK_SIZE * 3)),
            [2**40] * BLOCK_SIZE,
            "x" * 1000,
            [[1, 2], {"a": 1}],
        ]
    )
    return event


def fuzz_frames(seed: int, count: int, vocab: int, topic: bytes = b"kv-events") -> Iterator[Frames]:
    """``count`` malformed or hostile frame lists, deterministic for ``seed``."""
    rng = random.Random(seed)
    seq = 1000
    for _ in range(count):
        roll = rng.random()
        seq += rng.choice([1, 1, 1, 2, 50, -3, -500, 0])
        seq = max(0, seq)
        if roll < 0.10:
            yield [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.choice([1, 2, 4, 5]))]
        elif roll < 0.20:
            yield [topic, rng.randbytes(rng.choice([0, 1, 7, 9, 16])), _valid_payload(rng, vocab)]
        elif roll < 0.35:
            yield [topic, _seq(seq), rng.randbytes(rng.randint(0, 256))]
        elif roll < 0.50:
            payload = _valid_payload(rng, vocab)
            yield [topic, _seq(seq), payload[: rng.randrange(len(payload))]]
        elif roll < 0.60:
            flipped = bytearray(_valid_payload(rng, vocab))
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            yield [topic, _seq(seq), bytes(flipped)]
        elif roll < 0.75:
            yield [topic, _seq(seq), msgspec.msgpack.encode(_random_value(rng))]
        elif roll < 0.92:
            events = [_bad_event(rng, vocab) for _ in range(rng.randint(1, 3))]
            yield [topic, _seq(seq), msgspec.msgpack.encode([rng.random(), events, None])]
        elif roll < 0.96:
            hashes: list[ExternalBlockHash] = [rng.getrandbits(64) for _ in range(rng.randint(1, 50))]
            yield [topic, _seq(seq), encode_batch([BlockRemoved(hashes)], ts=0.0)]
        else:
            yield [topic, _seq(seq), encode_batch([AllBlocksCleared()], ts=0.0)]


async def _wait_digested(ctx: ChaosContext, timeout_s: float) -> float:
    """Seconds until the router's count of malformed frames stops moving for a second (the fuzz
    is consumed; the engines' own batches keep the other counters moving)."""
    last: list[int] = []

    async def settled() -> bool:
        nonlocal last
        sub = (await ctx.admin_get("/admin/index"))["subscriber"]
        now = [sub["num_malformed"], sub["num_resets"]]
        same, last = now == last, now
        return same

    return await poll_until(settled, timeout_s, 1.0)


async def fuzz_event_frames(ctx: ChaosContext) -> ScenarioResult:
    """Publish ``durations.event_frames`` fuzzed frames to the router, then one valid batch.

    Bounds: the router stays up and healthy, counts the bad frames as skipped, and indexes the
    valid batch sent after them.
    """
    res = ScenarioResult("fuzz_events", "5a. fuzzed KV event frames on the router's subscriber")
    pub_port, http_port = free_ports(2)
    zctx = zmq.asyncio.Context()
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.bind(f"tcp://{HOST}:{pub_port}")
    pod = f"http://{HOST}:{http_port}"
    headers = {"Authorization": f"Bearer {ctx.admin_token}"}
    body = {"url": pod, "eventsEndpoint": f"tcp://{HOST}:{pub_port}"}
    try:
        async with ctx.session.post(ctx.router_url + "/admin/endpoints", json=body, headers=headers) as resp:
            if resp.status != 201:
                raise AssertionError(f"adding the fuzz publisher: HTTP {resp.status}: {await resp.text()}")
        rng = random.Random(5)
        seq = 0
        fuzz_start = ctx.log.now()
        before = await ctx.admin_get("/admin/index")

        async def connected() -> bool:
            nonlocal seq
            await pub.send_multipart([b"kv-events", _seq(seq), _valid_payload(rng, ctx.vocab_size)])
            seq += 1
            return int((await ctx.endpoint_states())[pod]["indexed_blocks"]) > 0

        join_s = await poll_until(connected, 10.0, 0.1)
        if math.isnan(join_s):
            raise AssertionError("the router never indexed a valid batch from the fuzz publisher")
        res.figures["subscriber_join_s"] = round(join_s, 3)
        sent = 0
        for frames in fuzz_frames(seed=16, count=ctx.durations.event_frames, vocab=ctx.vocab_size):
            await pub.send_multipart(frames)
            sent += 1
            if sent % _SEND_BURST == 0:
                await asyncio.sleep(0.005)
        digest_s = await _wait_digested(ctx, DIGEST_TIMEOUT_S)
        # A clear, then 4 blocks: the pod's count reads 4 only once both were applied in order.
        final_seq = 1 << 40
        await pub.send_multipart([b"kv-events", _seq(final_seq), encode_batch([AllBlocksCleared()])])
        tokens = [rng.randrange(ctx.vocab_size) for _ in range(4 * BLOCK_SIZE)]
        valid = encode_batch([BlockStored([rng.getrandbits(64) for _ in range(4)], None, tokens, BLOCK_SIZE)])
        await pub.send_multipart([b"kv-events", _seq(final_seq + 1), valid])

        async def final_applied() -> bool:
            return int((await ctx.endpoint_states())[pod]["indexed_blocks"]) == 4

        applied_s = await poll_until(final_applied, 10.0, 0.1)
        after = await ctx.admin_get("/admin/index")
        sub_b, sub_a = before["subscriber"], after["subscriber"]
        ing_b, ing_a = before["ingest"], after["ingest"]
        skipped = (sub_a["num_malformed"] - sub_b["num_malformed"]) + (
            ing_a["num_bad_events"] - ing_b["num_bad_events"]
        )
        res.figures.update(
            frames_sent=sent,
            seconds_to_digest=digest_s,
            frames_skipped_malformed=sub_a["num_malformed"] - sub_b["num_malformed"],
            events_rejected=ing_a["num_bad_events"] - ing_b["num_bad_events"],
            publisher_resets_seen=sub_a["num_resets"] - sub_b["num_resets"],
            batches_applied=sub_a["num_batches"] - sub_b["num_batches"],
        )
        alive = ctx.fleet.router is not None and ctx.fleet.router.returncode is None
        async with ctx.session.get(ctx.router_url + "/health") as resp:
            healthy = resp.status == 200
        await ctx.load.wait_idle(ctx.load.options.request_timeout_s)
        during = ctx.load.window(fuzz_start, ctx.log.now())
        res.figures["load_p90_ttft_during_s"] = ttft_quantile(during, 0.9)
        res.check("failed requests through the router during the fuzz", num_failed(during), "==", 0)
        res.check("router crashes", 0 if alive else 1, "==", 0)
        res.check("router healthy after the fuzz", int(healthy), "==", 1)
        res.check("bad frames and events counted as skipped", skipped, ">=", 1)
        res.check("seconds to index a valid batch after the fuzz", applied_s, "<=", 5.0, "s")
    finally:
        async with ctx.session.delete(
            ctx.router_url + "/admin/endpoints", params={"url": pod}, headers=headers
        ) as resp:
            await resp.read()
        pub.close(linger=0)
        zctx.term()
    return res
