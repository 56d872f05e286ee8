"""``kvmesh router --workers N`` answers as one router: metrics of every worker, admin changes that
reach every worker (and a restarted one), explanations found on whichever worker answered."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from router_fakes import BLOCK, MODEL, FakeEngine, free_port

from kvmesh.router.usage import UsageLedger
from kvmesh.router.worker_mesh import LOCAL_HEADER, add_counts, merge_expositions
from kvmesh.router.workers import num_listening_sockets, worker_pids

AUTH = {"Authorization": "Bearer t"}


def _page(decisions: float, latency: float) -> str:
    registry = CollectorRegistry()
    Counter("kvmesh_router_decisions_total", "decisions", ["endpoint"], registry=registry).labels("a").inc(
        decisions
    )
    Histogram("kvmesh_router_schedule_seconds", "schedule", registry=registry, buckets=(0.001, 0.01)).observe(
        latency
    )
    return generate_latest(registry).decode()


def test_merged_exposition_labels_every_sample_with_its_worker() -> None:
    page = merge_expositions({0: _page(3, 0.0005), 2: _page(5, 0.005)}, num_workers=3)
    families = {f.name: f for f in text_string_to_metric_families(page.decode())}
    decisions = {
        s.labels["worker"]: s.value
        for s in families["kvmesh_router_decisions"].samples
        if s.name == "kvmesh_router_decisions_total"
    }
    assert decisions == {"0": 3.0, "2": 5.0}
    buckets = {
        (s.labels["worker"], s.labels["le"]): s.value
        for s in families["kvmesh_router_schedule_seconds"].samples
        if s.name.endswith("_bucket")
    }
    assert buckets[("0", "0.001")] == 1.0 and buckets[("2", "0.001")] == 0.0 and buckets[("2", "0.01")] == 1.0
    assert families["kvmesh_router_workers"].samples[0].value == 3.0
    assert families["kvmesh_router_workers_scraped"].samples[0].value == 2.0
    # one HELP/TYPE per family, its samples together: a valid page for Prometheus
    assert page.decode().count("# TYPE kvmesh_router_decisions_total counter") == 1


def _log_tail(log: Path | None) -> str:
    return "" if log is None else f"; the router's log:\n{log.read_text()[-3000:]}"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["", "a", "b"]),
            st.integers(0, 5000),
            st.none() | st.integers(0, 5000),
            st.dictionaries(st.sampled_from(["device", "cpu", "shared"]), st.integers(0, 500), max_size=2),
            st.integers(0, 1),
        ),
        max_size=30,
    )
)
def test_usage_added_over_workers_equals_one_ledger_of_every_request(requests) -> None:  # type: ignore[no-untyped-def]
    whole, workers = UsageLedger(), [UsageLedger(), UsageLedger()]
    for tenant, prompt, cached, tiers, worker in requests:
        for ledger in (whole, workers[worker]):
            ledger.add_request(tenant, prompt_tokens=prompt, cached_tokens=cached, cached_by_tier=tiers)
    assert add_counts(workers[0].snapshot(), workers[1].snapshot()) == whole.snapshot()


async def _wait_for(predicate: Any, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}{_log_tail(log)}"
        await asyncio.sleep(0.2)


@pytest.fixture
async def fresh() -> AsyncIterator[aiohttp.ClientSession]:
    # A new connection per request: the kernel picks the worker per connection.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        yield session


async def _metric_endpoints(session: aiohttp.ClientSession, url: str) -> dict[str, set[str]]:
    """Per worker, the endpoints its ``kvmesh_router_pending_prefill_requests`` samples name."""
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvmesh_router_pending_prefill_requests":
            for s in family.samples:
                found.setdefault(s.labels["worker"], set()).add(s.labels["endpoint"])
    return found


async def _complete(session: aiohttp.ClientSession, url: str, i: int) -> tuple[str, str]:
    body = {
        "model": MODEL,
        "prompt": list(range(5000 + 100 * i, 5000 + 100 * i + 2 * BLOCK)),
        "max_tokens": 1,
    }
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-kvmesh-endpoint"], resp.headers["x-request-id"]


@pytest.mark.skipif(sys.platform != "linux", reason="SO_REUSEPORT spreading and /proc are Linux's")
# pools are served on aiohttp alone (--aiohttp-only), one model behind the router's front
@pytest.mark.parametrize("pooled", [False, True], ids=["one-model", "pools-aiohttp-only"])
async def test_workers_answer_as_one_router(engines, fresh: aiohttp.ClientSession, tmp_path, pooled) -> None:  # type: ignore[no-untyped-def]
    fleet: list[FakeEngine] = await engines(3)
    first, second, added = (e.url for e in fleet)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Under pools the admin API is each pool's, at /pools/<name>/admin/...
    admin = f"{url}/pools/p/admin" if pooled else f"{url}/admin"
    config, log = tmp_path / "router.yaml", tmp_path / "router.log"
    endpoints = [{"url": first}, {"url": second}]
    config.write_text(
        json.dumps(
            {"adminToken": "t", "policy": "precise", "model": MODEL, "endpoints": endpoints}
            if not pooled
            else {
                "adminToken": "t",
                "pools": [{"name": "p", "model": MODEL, "policy": "precise", "endpoints": endpoints}],
            }
        )
    )
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "kvmesh", "router", "--config", str(config), "--port", str(port),
          "--workers", "2", "--log-level", "warning", *(["--aiohttp-only"] if pooled else [])],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"), env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    try:

        async def listening() -> bool:
            return num_listening_sockets(port) == 2

        await _wait_for(listening, 120, "two workers listening")

        async def both_in_metrics() -> bool:
            return set(await _metric_endpoints(fresh, url)) == {"0", "1"}

        await _wait_for(both_in_metrics, 30, "a metrics page with both workers")
        for _ in range(6):  # whichever worker takes the scrape, the page holds both
            assert await _metric_endpoints(fresh, url) == {"0": {first, second}, "1": {first, second}}

        async with fresh.post(f"{admin}/endpoints", json={"url": added}, headers=AUTH) as resp:
            assert resp.status == 201, await resp.text()
            assert set((await resp.json())["workers"].values()) == {201}
        async with fresh.delete(f"{admin}/endpoints", params={"url": first}, headers=AUTH) as resp:
            assert resp.status == 200, await resp.text()
            assert set((await resp.json())["workers"].values()) == {200}
        assert await _metric_endpoints(fresh, url) == {"0": {second, added}, "1": {second, added}}

        # Each request is explained by whichever worker takes the question.
        served = [await _complete(fresh, url, i) for i in range(8)]
        assert {endpoint for endpoint, _ in served} <= {second, added}
        for _, request_id in served:
            async with fresh.get(f"{admin}/explain/{request_id}", headers=AUTH) as resp:
                assert resp.status == 200, (request_id, await resp.text())
        for _ in range(4):  # and counted once, whichever worker is asked
            async with fresh.get(f"{admin}/usage", headers=AUTH) as resp:
                usage = await resp.json()
            assert sum(row["requests"] for row in usage["tenants"].values()) == len(served), usage
            assert set(usage["workers"].values()) == {200}
        for _ in range(4):  # a client cannot make one worker answer alone
            headers = {**AUTH, LOCAL_HEADER: "1"}
            async with fresh.get(f"{admin}/usage", headers=headers) as resp:
                usage = await resp.json()
            assert sum(row["requests"] for row in usage["tenants"].values()) == len(served), usage
            assert set(usage["workers"].values()) == {200}
        for _ in range(4):  # every worker's latest requests, newest first, whichever is asked
            async with fresh.get(f"{admin}/explain", params={"limit": "100"}, headers=AUTH) as resp:
                recent = await resp.json()
            assert sorted(e["request_id"] for e in recent["requests"]) == sorted(r for _, r in served)
            times = [e["at"] for e in recent["requests"]]
            assert times == sorted(times, reverse=True) and set(recent["workers"].values()) == {200}
            async with fresh.get(f"{admin}/explain", params={"limit": "3"}, headers=AUTH) as resp:
                assert [e["request_id"] for e in (await resp.json())["requests"]] == [
                    e["request_id"] for e in recent["requests"][:3]
                ]
            async with fresh.get(f"{admin}/index", headers=AUTH) as resp:
                index = await resp.json()
            assert list(index["peers"]) == [str(1 - index["worker"])], index.get("peers")
            assert index["peers"][str(1 - index["worker"])]["index"].keys() == index["index"].keys()

        # A worker that starts again copies its peer's endpoints: the one added and not the one
        # removed at run time.
        victim = worker_pids(proc.pid)[0]
        os.kill(victim, signal.SIGKILL)

        async def replaced() -> bool:
            pids = worker_pids(proc.pid)
            return victim not in pids and len(pids) == 2 and num_listening_sockets(port) == 2

        await _wait_for(replaced, 120, "the killed worker's successor listening")

        async def caught_up() -> bool:
            return await _metric_endpoints(fresh, url) == {"0": {second, added}, "1": {second, added}}

        await _wait_for(caught_up, 30, "the new worker to adopt its peer's endpoints", log)
        after = [await _complete(fresh, url, 100 + i) for i in range(8)]
        assert {endpoint for endpoint, _ in after} <= {second, added}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    stderr = log.read_text()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
