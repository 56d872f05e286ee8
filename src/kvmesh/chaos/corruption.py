"""Corrupt chunks in every store tier: none may be served, all are recomputed, forgeries are rejected.

Per tier (RAM, local disk, shared directory, Redis/Valkey) a :class:`KVCacheEngine` holding only
that tier stores prompts of four chunks. Every chunk is then damaged in place, through the tier's
backend, in one of three ways, in turn::

    mutate     one bit of the encoded chunk flipped
    truncate   the encoded chunk cut at a random byte
    swap       the chunk's bytes exchanged with another chunk's (valid, but for another key)

Retrieving every prompt must then find nothing (``0 served``), and storing the prompts again (the
engine's recompute) must make every chunk readable and byte-identical to the original. With a
fleet HMAC key, chunks forged without the key (no tag, or a tag made with another key, each with a
valid checksum) must be rejected the same way.
"""

from __future__ import annotations

import logging
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from kvmesh.chaos.bounds import ScenarioResult
from kvmesh.core.hashing import Namespace
from kvmesh.store.cache_engine import KVCacheEngine
from kvmesh.store.codec import ChunkCodec
from kvmesh.store.config import StoreConfig
from kvmesh.store.keys import StoreKey
from kvmesh.store.tiered import Tier

CHUNK = 16
CHUNKS_PER_PROMPT = 4
KV_SHAPE = (2, 2, 2, CHUNK * CHUNKS_PER_PROMPT, 8)
HMAC_KEY = "chaos-fleet-key"
NS = Namespace("chaos-corruption")
DAMAGES = ("mutate", "truncate", "swap")


@dataclass(slots=True)
class TierOutcome:
    """What one tier did with its damaged chunks."""

    tier: str
    chunks: int
    detected: int
    served: int
    recomputed_identical: int


def _config(tier: str, root: Path, redis_url: str | None, hmac_key: str | None) -> StoreConfig:
    base = StoreConfig(chunk_size=CHUNK, block_size=CHUNK, hmac_key=hmac_key, redis_key_prefix="kvmesh-chaos")
    match tier:
        case "cpu":
            return base
        case "disk":
            return msgspec.structs.replace(
                base, local_cpu=False, local_disk=str(root / "disk"), max_local_disk_size=1.0
            )
        case "fs":
            return msgspec.structs.replace(base, local_cpu=False, shared_dir=str(root / "shared"))
        case "redis":
            return msgspec.structs.replace(base, local_cpu=False, remote_url=redis_url)
    raise ValueError(f"unknown tier {tier!r}")


def _prompts(rng: random.Random, num_prompts: int) -> list[tuple[list[int], np.ndarray]]:
    out = []
    for _ in range(num_prompts):
        tokens = [rng.randrange(3, 259) for _ in range(KV_SHAPE[3])]
        kv = np.asarray(rng.random(), np.float32) + np.random.default_rng(
            rng.getrandbits(32)
        ).standard_normal(KV_SHAPE, dtype=np.float32)
        out.append((tokens, kv))
    return out


def _damage(rng: random.Random, how: str, value: bytes, other: bytes) -> bytes:
    if how == "mutate":
        out = bytearray(value)
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out)
    if how == "truncate":
        return value[: rng.randrange(len(value))]
    return other


def _forge(rng: random.Random, key: StoreKey, n: int) -> bytes:
    kv = np.full((*KV_SHAPE[:3], CHUNK, KV_SHAPE[4]), 7.0, np.float32)
    codec = ChunkCodec() if n % 2 == 0 else ChunkCodec(hmac_key=b"not-the-fleet-key")
    return codec.encode(key, kv)


async def _run_tier(
    tier: str, num_chunks: int, root: Path, redis_url: str | None, *, forge: bool, seed: int
) -> TierOutcome:
    rng = random.Random(seed)
    engine = KVCacheEngine.from_config(_config(tier, root, redis_url, HMAC_KEY if forge else None))
    try:
        await engine.flush()
        prompts = _prompts(rng, max(1, num_chunks // CHUNKS_PER_PROMPT))
        for tokens, kv in prompts:
            await engine.store(tokens, NS, kv)
        await engine.drain()
        (layer,) = engine.tiered.tiers
        keys = [k for tokens, _ in prompts for k in engine.chunk_keys(tokens, NS)]
        values = await layer.backend.get_many(keys)
        assert all(v is not None for v in values), f"tier {tier} lost chunks before they were damaged"
        if forge:
            bad = [_forge(rng, k, n) for n, k in enumerate(keys)]
        else:
            bad = [
                _damage(
                    rng,
                    DAMAGES[n % len(DAMAGES)],
                    bytes(v or b""),
                    bytes(values[(n + 1) % len(values)] or b""),
                )
                for n, v in enumerate(values)
            ]
        await _put_raw(layer, list(zip(keys, bad, strict=True)))
        corrupt_before = layer.counters.corrupt
        served = 0
        for tokens, _ in prompts:
            served += (await engine.retrieve(tokens, NS)).num_tokens // CHUNK
        detected = layer.counters.corrupt - corrupt_before
        for tokens, kv in prompts:  # the engine's recompute: the same prompt's KV stored again
            await engine.store(tokens, NS, kv)
        await engine.drain()
        identical = 0
        for tokens, kv in prompts:
            got = await engine.retrieve(tokens, NS)
            if got.kv is not None and got.num_tokens == kv.shape[3] and np.array_equal(got.kv, kv):
                identical += CHUNKS_PER_PROMPT
        await engine.flush()
        return TierOutcome(tier, len(keys), detected, served, identical)
    finally:
        await engine.aclose()


async def _put_raw(layer: Tier, items: list[tuple[StoreKey, bytes]]) -> None:
    """Overwrite encoded chunks in the tier's backend, past the codec."""
    stored = await layer.backend.put_many(items)
    assert stored == len(items), f"tier {layer.name} took {stored} of {len(items)} damaged chunks"


async def corruption(num_chunks: int, redis_url: str | None) -> ScenarioResult:
    """Damage ``num_chunks`` chunks in each tier (and forge a quarter as many under HMAC).

    Bounds: 0 damaged or forged chunks served; every damaged chunk detected; every chunk
    recomputed byte-identical.
    """
    res = ScenarioResult("corruption", "4. corrupt and forged chunks in every tier")
    tiers = ["cpu", "disk", "fs"] + (["redis"] if redis_url else [])
    store_log = logging.getLogger("kvmesh.store")
    level = store_log.level
    store_log.setLevel(logging.ERROR)  # one warning per corrupt chunk otherwise
    outcomes: list[TierOutcome] = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvmesh-chaos-store-") as tmp:
            for n, tier in enumerate(tiers):
                outcomes.append(
                    await _run_tier(tier, num_chunks, Path(tmp) / tier, redis_url, forge=False, seed=n)
                )
                forged = await _run_tier(
                    tier,
                    max(CHUNKS_PER_PROMPT, num_chunks // 4),
                    Path(tmp) / f"{tier}-hmac",
                    redis_url,
                    forge=True,
                    seed=100 + n,
                )
                outcomes.append(
                    TierOutcome(
                        f"{tier}+hmac",
                        forged.chunks,
                        forged.detected,
                        forged.served,
                        forged.recomputed_identical,
                    )
                )
    finally:
        store_log.setLevel(level)
    for o in outcomes:
        res.figures[f"{o.tier}_chunks"] = o.chunks
        res.figures[f"{o.tier}_detected"] = o.detected
    total = sum(o.chunks for o in outcomes)
    res.figures["tiers"] = ", ".join(tiers)
    res.check("damaged or forged chunks served", sum(o.served for o in outcomes), "==", 0)
    res.check("damaged or forged chunks not detected", total - sum(o.detected for o in outcomes), "==", 0)
    res.check(
        "chunks not recomputed identical", total - sum(o.recomputed_identical for o in outcomes), "==", 0
    )
    return res
