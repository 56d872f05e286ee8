"""The engine's KV event stream, read from a real ZMQ socket by ``kvmesh events listen``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import aiohttp

from kvmesh.core.hashing import BlockHasher, Namespace
from kvmesh.engine.prefix_cache import engine_block_hash


def apply(events: list[dict], held: set[int]) -> None:
    for ev in events:
        if ev["type"] == "BlockStored":
            held.update(ev["block_hashes"])
        elif ev["type"] == "BlockRemoved":
            held.difference_update(ev["block_hashes"])
        elif ev["type"] == "AllBlocksCleared":
            held.clear()


async def test_listen_sees_exactly_the_cached_blocks(make_engine) -> None:
    # 40 blocks of capacity: the prompts below overflow it, so evictions are in the stream too.
    eng = await make_engine(
        kv_capacity_tokens=640, events="tcp://127.0.0.1:0", events_replay="tcp://127.0.0.1:0"
    )
    info = eng.info_dict()
    url = f"{eng.url}/v1/completions"
    async with aiohttp.ClientSession() as http:

        async def run(i: int, tenant: str = "") -> None:
            body = {"prompt": [100 + i] * 8 + list(range(1, 150)), "max_tokens": 20}
            headers = {"x-tenant-id": tenant} if tenant else {}
            async with http.post(url, json=body, headers=headers) as r:
                assert r.status == 200

        for i in range(4):  # published before anyone listens: comes back through replay
            await run(i)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvmesh", "events", "listen",
            f"{info['events_endpoint']},replay={info['replay_endpoint']}", "--timeout", "60",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        assert proc.stdout is not None
        events: list[dict] = []
        try:
            events.append(json.loads(await asyncio.wait_for(proc.stdout.readline(), 30)))
            for i in range(4, 8):  # published live
                await run(i, tenant="acme" if i % 2 else "")
            expected = {engine_block_hash(k) for k in eng.core.cache.cached_keys()}
            held: set[int] = set()
            while True:
                apply(events[-1:], held)
                if held == expected:
                    break
                events.append(json.loads(await asyncio.wait_for(proc.stdout.readline(), 30)))
        finally:
            proc.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err
    assert held == expected
    assert any(e["type"] == "BlockRemoved" for e in events)
    assert all(e["medium"] == "GPU" for e in events)
    assert b"malformed=0" in err


async def test_events_rehash_to_the_engine_hashes(make_engine) -> None:
    """A router re-hashing ``token_ids`` in the namespace named by /kvmesh/info and ``extra_keys``
    gets keys whose first 8 bytes are the engine's block hashes."""
    from kvmesh.core.event_transport import ZmqEventSubscriber

    eng = await make_engine(events="tcp://127.0.0.1:0", events_replay="tcp://127.0.0.1:0")
    info = eng.info_dict()
    async with aiohttp.ClientSession() as http:
        for tenant in ("", "t1"):
            headers = {"x-tenant-id": tenant} if tenant else {}
            async with http.post(
                f"{eng.url}/v1/completions",
                json={"prompt": list(range(1, 70)), "max_tokens": 1},
                headers=headers,
            ) as r:
                assert r.status == 200
    batches = []
    got = asyncio.Event()

    def on_batch(pod, seq, batch) -> None:
        batches.append(batch)
        if sum(len(b.events) for b in batches) >= 2:
            got.set()

    sub = ZmqEventSubscriber(on_batch)
    sub.add_publisher("e", info["events_endpoint"], info["replay_endpoint"])
    task = asyncio.create_task(sub.run())
    await asyncio.wait_for(got.wait(), 30)
    await sub.aclose()
    await task
    stored = [e for b in batches for e in b.events]
    assert len(stored) == 2
    for ev in stored:
        tenant = ev.extra_keys[0][0] if ev.extra_keys else ""
        ns = Namespace(info["model"], info["revision"], "", tenant)
        keys = BlockHasher(ns, info["block_size"], info["hash_algo"]).hash_blocks(ev.token_ids)
        assert [engine_block_hash(k) for k in keys] == ev.block_hashes
        assert ev.parent_block_hash is None and len(ev.token_ids) == 4 * 16
    assert stored[0].extra_keys is None and stored[1].extra_keys[0] == ["t1"]
