"""The router in front of real emulated engine processes (``kvmesh engine --emulate``).

Three engines start once for the module; each test uses its own token range so caches from one
test never help another. The kill test runs last because it takes an engine down.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from router_fakes import EngineProcess, start_engine_processes

from kvmesh.router.config import router_config_from_dict
from kvmesh.router.gateway import ENDPOINT_HEADER, Gateway
from kvmesh.router.types import RoutingRequest

pytestmark = pytest.mark.slow

N_ENGINES = 3
PREFIX_TOKENS = 256


@pytest.fixture(scope="module")
def fleet():
    procs = start_engine_processes(N_ENGINES)
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def tokenizer():
    from kvmesh.core.tokens import Tokenizer

    return Tokenizer.load("smollm2")


@contextlib.asynccontextmanager
async def router(fleet: list[EngineProcess], tokenizer: Any, policy: str, **overrides: Any):
    raw: dict[str, Any] = {
        "endpoints": [{"url": p.url} for p in fleet],
        "policy": policy,
        "seed": 3,
        "health": {"intervalS": 0.25, "timeoutS": 0.5, "failureThreshold": 2, "metricsIntervalS": 0.5},
    }
    raw.update(overrides)
    gw = Gateway(router_config_from_dict(raw), tokenizer=tokenizer)
    client = TestClient(TestServer(gw.app))
    await client.start_server()
    try:
        yield gw, client
    finally:
        await client.close()


async def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def indexed_blocks(gw: Gateway, tokens: list[int], pod: str, tenant: str = "") -> int:
    """Blocks of ``tokens`` the router's index says ``pod`` holds as a prefix."""
    if gw.applier is None:
        return 0
    request = RoutingRequest("probe", tokens, gw.applier.namespace(tenant=tenant))
    match = gw.scheduler.match(request).pods.get(pod)  # type: ignore[call-overload]
    return 0 if match is None else match.num_blocks


def two_visit_workload(base: int, groups: int, seed: int) -> list[tuple[int, list[int]]]:
    """Each group's shared prefix is requested twice (unique suffixes), passes shuffled apart."""
    rng = random.Random(seed)
    prefixes = [[base + g * 300 + i for i in range(PREFIX_TOKENS)] for g in range(groups)]
    first, second = list(range(groups)), list(range(groups))
    rng.shuffle(first)
    rng.shuffle(second)
    if second[0] == first[-1]:
        second.reverse()
    out = []
    for visit, order in enumerate((first, second)):
        for g in order:
            suffix = [base + 900 + visit * 30 + i for i in range(20)]
            out.append((g, prefixes[g] + suffix))
    return out


async def run_workload(
    client: TestClient, workload: list[tuple[int, list[int]]], **headers: str
) -> tuple[int, int, list[str]]:
    """Send sequentially; return (realized cached tokens, oracle cached tokens, endpoints)."""
    seen: set[int] = set()
    realized = oracle = 0
    chosen = []
    for group, prompt in workload:
        resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=headers)
        body = await resp.json()
        assert resp.status == 200, body
        realized += body["usage"]["prompt_tokens_details"]["cached_tokens"]
        oracle += PREFIX_TOKENS if group in seen else 0
        seen.add(group)
        chosen.append(resp.headers[ENDPOINT_HEADER])
        await asyncio.sleep(0.02)
    return realized, oracle, chosen


async def test_precise_hits_reach_the_oracle_and_round_robin_shows_one_in_n(fleet, tokenizer):
    async with router(fleet, tokenizer, "precise") as (gw, client):
        await wait_for(lambda: gw.intake is not None and len(gw.intake.sources) == N_ENGINES)
        realized, oracle, _ = await run_workload(client, two_visit_workload(1000, 30, seed=1))
    assert oracle == 30 * PREFIX_TOKENS
    assert realized >= 0.95 * oracle

    async with router(fleet, tokenizer, "round-robin") as (gw, client):
        rr_realized, rr_oracle, chosen = await run_workload(client, two_visit_workload(12_000, 30, seed=2))
    assert len(set(chosen)) == N_ENGINES
    share = rr_realized / rr_oracle
    # a second visit lands on the first visit's engine with probability 1/N
    assert 0.1 <= share <= 0.6, share
    assert realized > 1.5 * rr_realized


async def test_tenants_never_share_blocks(fleet, tokenizer):
    async with router(fleet, tokenizer, "precise") as (gw, client):
        prompt = list(range(30_000, 30_000 + 320))
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 2}
        first = await client.post("/v1/completions", json=body, headers={"x-tenant-id": "acme"})
        assert (await first.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        holder = first.headers[ENDPOINT_HEADER]
        await wait_for(lambda: indexed_blocks(gw, prompt, holder, "acme") == 20)
        for tenant in ("globex", "initech"):
            resp = await client.post("/v1/completions", json=body, headers={"x-tenant-id": tenant})
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = await client.post("/v1/completions", json=body, headers={"x-tenant-id": "acme"})
        assert again.headers[ENDPOINT_HEADER] == holder
        assert (await again.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 304
        # cache_salt in the body is the same tenant as the header
        salted = await client.post("/v1/completions", json={**body, "cache_salt": "acme"})
        assert salted.headers[ENDPOINT_HEADER] == holder


async def test_chat_prompts_route_by_the_engines_own_tokens(fleet, tokenizer):
    async with router(fleet, tokenizer, "precise") as (gw, client):
        system = "You are a terse assistant. " + " ".join(f"rule {i}: answer briefly." for i in range(40))
        body = {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            "max_tokens": 2,
        }
        first = await client.post("/v1/chat/completions", json=body)
        assert first.status == 200
        holder = first.headers[ENDPOINT_HEADER]
        tokens = tokenizer.apply_chat_template(body["messages"])
        await wait_for(lambda: indexed_blocks(gw, tokens, holder) == len(tokens) // 16)
        for q in ("hello", "what now?", "and then"):
            body["messages"][1]["content"] = q  # type: ignore[index]
            resp = await client.post("/v1/chat/completions", json=body)
            data = await resp.json()
            assert resp.headers[ENDPOINT_HEADER] == holder
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256


async def test_restarted_router_rebuilds_its_index_from_replay(fleet, tokenizer):
    prompt = list(range(40_000, 40_000 + 512))
    async with router(fleet, tokenizer, "precise") as (gw, client):
        resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        holder = resp.headers[ENDPOINT_HEADER]
        await wait_for(lambda: indexed_blocks(gw, prompt, holder) == 32)
    async with router(fleet, tokenizer, "precise", seed=99) as (gw, client):
        await wait_for(lambda: indexed_blocks(gw, prompt, holder) == 32)
        assert gw.intake is not None and gw.intake.subscriber.stats.num_replayed > 0
        for i in range(3):
            resp = await client.post(
                "/v1/completions", json={"prompt": prompt + [7] * (i + 1), "max_tokens": 2}
            )
            assert resp.headers[ENDPOINT_HEADER] == holder
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 512


async def test_killed_engine_leaves_within_2s_and_only_in_flight_requests_fail(fleet, tokenizer):
    victim = fleet[0]
    async with router(fleet, tokenizer, "load") as (gw, client):
        records: list[tuple[float, float, int, str]] = []
        stop = asyncio.Event()

        async def worker(w: int) -> None:
            i = 0
            while not stop.is_set():
                prompt = list(range(44_000 + w * 500 + i % 5, 44_000 + w * 500 + i % 5 + 64))
                start = time.monotonic()
                resp = await client.post(
                    "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "ignore_eos": True}
                )
                await resp.read()
                records.append((start, time.monotonic(), resp.status, resp.headers.get(ENDPOINT_HEADER, "")))
                i += 1

        workers = [asyncio.create_task(worker(w)) for w in range(6)]
        await wait_for(lambda: sum(1 for r in records if r[3] == victim.url) >= 3)
        killed_at = time.monotonic()
        victim.kill()
        await wait_for(lambda: not gw.pool.get(victim.url).state.healthy, timeout=5)  # type: ignore[union-attr]
        removed_after = time.monotonic() - killed_at
        await asyncio.sleep(2.5)
        stop.set()
        await asyncio.gather(*workers)

    assert removed_after <= 2.0, removed_after
    failed = [r for r in records if r[2] != 200]
    # only requests already running when the engine died may fail
    assert all(start < killed_at for start, _, _, _ in failed), failed
    late = [r for r in records if r[0] > killed_at + 2.0]
    assert late and all(r[2] == 200 and r[3] != victim.url for r in late)
