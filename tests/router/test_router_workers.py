"""``kvmesh router --workers N``: processes sharing one port, each with the whole index, restarted one by one."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
from router_fakes import BLOCK, MODEL, FakeEngine, free_port

from kvmesh.router import workers as workers_mod
from kvmesh.router.workers import WorkerSupervisor, num_listening_sockets, worker_pids

PROMPT = list(range(1000, 1000 + 8 * BLOCK))


def _exit_at_once(index: int) -> None:
    sys.exit(3)


def _sleep_forever(index: int) -> None:
    time.sleep(3600)


def test_supervisor_rejects_no_workers() -> None:
    with pytest.raises(ValueError, match="got 0"):
        WorkerSupervisor(_sleep_forever, 0)


def test_supervisor_starts_an_exited_worker_again_after_the_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers_mod, "RESPAWN_BACKOFF_S", 0.0)
    supervisor = WorkerSupervisor(_exit_at_once, 2)
    supervisor.start()
    try:
        first = supervisor.pids
        for slot in supervisor._slots:
            slot.process.join(30)
        assert [slot.process.exitcode for slot in supervisor._slots] == [3, 3]
        assert supervisor.check() == 2
        assert all(p is not None for p in supervisor.pids) and supervisor.pids != first
    finally:
        supervisor.stop()


def test_supervisor_stop_ends_running_workers(capfd: pytest.CaptureFixture[str]) -> None:
    supervisor = WorkerSupervisor(_sleep_forever, 2)
    supervisor.start()
    time.sleep(0.1)  # the workers are still starting: their interpreters import and unpickle
    supervisor.stop()
    assert all(not slot.process.is_alive() for slot in supervisor._slots)
    # stopped by SIGINT (sent again once each worker listens for it), not killed at the timeout
    assert [slot.process.exitcode for slot in supervisor._slots] == [0, 0]
    assert "Traceback" not in capfd.readouterr().err
    assert supervisor.check() == 0, "a stopping supervisor starts nothing"


async def _wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def _served_by(url: str) -> str:
    # A new connection per request: the kernel picks the worker per connection.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return str((await resp.json())["choices"][0]["text"])


async def _index_reports(url: str) -> list[dict]:  # type: ignore[type-arg]
    """``/admin/index`` of each worker (new connections until both have answered)."""
    found: dict[int, dict] = {}  # type: ignore[type-arg]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for _ in range(200):
            async with session.get(f"{url}/admin/index", headers={"Authorization": "Bearer t"}) as resp:
                body = await resp.json()
            assert "ingest_split" in body, body
            found[body["ingest_split"]["worker"]] = body
            if len(found) == 2:
                break
    return list(found.values())


@pytest.mark.skipif(sys.platform != "linux", reason="SO_REUSEPORT spreading and /proc are Linux's")
@pytest.mark.parametrize("split", [[], ["--split-events"]], ids=["every-worker-ingests", "split-events"])
async def test_workers_share_the_port_and_each_restarted_worker_rebuilds_the_index(engines, split) -> None:  # type: ignore[no-untyped-def]
    # Split: each engine's events go to one worker, which sends its index writes to the other; a
    # restarted worker learns its engine's blocks from the replay and the other's from a snapshot.
    fleet: list[FakeEngine] = await engines(2)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "kvmesh", "router", "--endpoints", ",".join(e.url for e in fleet),
         "--policy", "precise", "--port", str(port), "--model", MODEL, "--workers", "2",
         "--log-level", "warning", "--admin-token", "t", *split],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    try:
        await _wait_for(lambda: num_listening_sockets(port) == 2, 120, "two workers listening")
        first = await _served_by(url)
        holder = next(e for e in fleet if e.name == first)
        await _wait_for(lambda: len(holder.cache) == len(PROMPT) // BLOCK, 10, "the engine's cache")
        await asyncio.sleep(2.0)  # the events reach both workers' subscribers

        for round_ in range(2):
            # Stop one worker: until its successor listens, the other serves every connection.
            victim = worker_pids(proc.pid)[0]
            os.kill(victim, signal.SIGTERM)
            await _wait_for(
                lambda v=victim: v not in worker_pids(proc.pid),  # type: ignore[misc]
                30,
                "the worker to exit",
            )
            assert [await _served_by(url) for _ in range(6)] == [first] * 6, f"round {round_}"
            # Its successor learns the engine's blocks from the replay socket, not from new events.
            await _wait_for(lambda: num_listening_sockets(port) == 2, 120, "the restarted worker listening")
            await asyncio.sleep(3.0)  # its replay, on a machine that may be busy
        assert len(worker_pids(proc.pid)) == 2
        # Both original workers are gone: every answer now comes from a worker restarted after the
        # prompt's events were published.
        assert [await _served_by(url) for _ in range(8)] == [first] * 8
        assert sum(len(e.received) for e in fleet if e is not holder) == 0
        if split:
            reports = await _index_reports(url)
            assert sorted(r["ingest_split"]["worker"] for r in reports) == [0, 1]
            # each worker subscribes to one engine, and holds the blocks of both
            assert sorted(p for r in reports for p in r["ingest_split"]["pods"]) == sorted(
                e.url for e in fleet
            )
            assert {r["index"]["num_keys"] for r in reports} == {len(PROMPT) // BLOCK}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, stderr = await asyncio.wait_for(proc.communicate(), 30)
        except TimeoutError:
            proc.kill()
            _, stderr = await proc.communicate()
    assert proc.returncode == 0, stderr.decode()
    assert b"Traceback" not in stderr, stderr.decode()


def test_workers_need_a_fixed_port() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "kvmesh", "router", "--endpoints", "http://127.0.0.1:1", "--workers", "2",
         "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "--workers needs a fixed --port" in bad.stderr


def test_split_events_needs_workers() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "kvmesh", "router", "--endpoints", "http://127.0.0.1:1", "--split-events"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "--split-events needs --workers 2 or more" in bad.stderr


def test_workers_flag_rejects_zero() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "kvmesh", "router", "--endpoints", "http://127.0.0.1:1", "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "--workers must be >= 1" in bad.stderr
