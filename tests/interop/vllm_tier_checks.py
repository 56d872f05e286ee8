"""Checks of kvmesh as a vLLM secondary tier, run with vLLM's interpreter (``.venv-vllm``).

``test_interop_vllm_tier.py`` runs every check in one subprocess (vLLM's import is most of a
check's time): ``python vllm_tier_checks.py SPEC.json RESULTS.json``, where the spec lists each
check's name, work directory, Valkey URL and Valkey pid, and the results say per check whether it
passed, what it printed and its traceback. The tier is built by vLLM's own factory from the config
a user writes.

Two tiers on two CPU-tier regions (two vLLM servers) share chunks through a real Valkey and
through a shared directory; faults fail only the affected keys; the router indexes the events.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import signal
import sys
import time
import traceback
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

from kvmesh.integrations.vllm_tier import KVMeshSecondaryTier

CHUNKS = 8
ROW_BYTES = 4096


def make_region(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(CHUNKS, ROW_BYTES), dtype=np.uint8)


def build_tier(region: np.ndarray, **extra: Any) -> KVMeshSecondaryTier:
    config = {
        "type": "KVMeshSecondaryTier",
        "module_path": "kvmesh.integrations.vllm_tier",
        "model": "m",
        **extra,
    }
    spec = SimpleNamespace(vllm_config=None)
    tier = SecondaryTierFactory.create_secondary_tier(config, memoryview(region), spec)  # type: ignore[arg-type]
    assert isinstance(tier, KVMeshSecondaryTier)
    return tier


def keys(n: int, salt: int = 0) -> list[OffloadKey]:
    return [make_offload_key(bytes([salt, i]) * 16, 0) for i in range(n)]


_job_ids = iter(range(1, 1 << 30))


def run_job(tier: KVMeshSecondaryTier, ks: list[OffloadKey], chunk_ids: list[int], load: bool) -> JobResult:
    job = TransferJob(next(_job_ids), ks, np.array(chunk_ids), load, ReqContext("r"))
    (tier.submit_load if load else tier.submit_store)(job)
    tier.drain_jobs()
    results = [r for r in tier.get_finished_jobs() if r.job_id == job.job_id]
    assert len(results) == 1
    return results[0]


def lookup(tier: KVMeshSecondaryTier, key: OffloadKey, req: str = "q") -> LookupResult:
    ctx = ReqContext(req)
    result = tier.lookup(key, ctx)
    deadline = time.monotonic() + 10
    while result is LookupResult.RETRY and time.monotonic() < deadline:
        time.sleep(0.01)
        result = tier.lookup(key, ctx)
    return result


def check_share(backend: dict[str, Any]) -> None:
    """Chunks one tier stores, another tier on another region finds and loads byte for byte."""
    writer_region, reader_region = make_region(1), np.zeros((CHUNKS, ROW_BYTES), np.uint8)
    writer, reader = build_tier(writer_region, **backend), build_tier(reader_region, **backend)
    try:
        ks = keys(3)
        assert run_job(writer, ks, [5, 2, 7], load=False).success
        assert all(lookup(reader, k) is LookupResult.HIT for k in ks)
        assert lookup(reader, keys(1, salt=9)[0]) is LookupResult.MISS
        assert run_job(reader, ks, [0, 1, 3], load=True).success
        for src, dst in zip([5, 2, 7], [0, 1, 3], strict=True):
            assert bytes(reader_region[dst]) == bytes(writer_region[src])
        events = list(writer.take_events())
        assert [list(e.keys) for e in events] == [ks] and not events[0].removed
        assert writer.counters["stores_ok"] == 1 and reader.counters["loads_ok"] == 1
        reported = writer.get_stats()
        assert reported is not None and reported.reduce()["vllm:kv_offload_kvmesh_stores_ok"] == 1
        assert writer.get_stats() is None  # increases are reported once
        assert set(KVMeshSecondaryTier.build_metric_definitions({})) >= set(reported.reduce())
    finally:
        writer.shutdown()
        reader.shutdown()


def check_corrupt_and_missing(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    region = make_region(2)
    tier = build_tier(region, shared_dir=str(shared), hmac_key="fleet")
    try:
        ks = keys(4, salt=1)
        assert run_job(tier, ks, [0, 1, 2, 3], load=False).success
        files = sorted(p for p in shared.rglob("*") if p.is_file() and p.stat().st_size >= ROW_BYTES)
        assert len(files) == 4
        target = tier._key(ks[2]).chunk.hex()
        (victim,) = [p for p in files if target in p.name]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        out = np.zeros((CHUNKS, ROW_BYTES), np.uint8)
        other = build_tier(out, shared_dir=str(shared), hmac_key="fleet")
        try:
            result = run_job(other, ks, [4, 5, 6, 7], load=True)
            assert not result.success and list(result.successful_keys or []) == ks[:2]
            assert bytes(out[4]) == bytes(region[0]) and bytes(out[5]) == bytes(region[1])
            missing = run_job(other, keys(2, salt=7), [0, 1], load=True)
            assert not missing.success and not missing.successful_keys
            wrong_key = build_tier(
                np.zeros((CHUNKS, ROW_BYTES), np.uint8), shared_dir=str(shared), hmac_key="x"
            )
            try:
                assert not run_job(wrong_key, ks[:1], [0], load=True).success
            finally:
                wrong_key.shutdown()
        finally:
            other.shutdown()
    finally:
        tier.shutdown()


def check_dead_server(url: str) -> None:
    """``url`` names a Valkey that was stopped."""
    tier = build_tier(make_region(3), remote_url=url, remote_timeout_s=0.2)
    try:
        ks = keys(2, salt=3)
        assert not run_job(tier, ks, [0, 1], load=False).success
        assert lookup(tier, ks[0]) is LookupResult.MISS
        assert not run_job(tier, ks, [0, 1], load=True).success
        assert not list(tier.take_events())
    finally:
        tier.shutdown()


def check_slow_server(url: str, pid: int) -> None:
    """``pid`` is the Valkey at ``url``; stopped (SIGSTOP), it holds connections and answers nothing."""
    tier = build_tier(make_region(4), remote_url=url, job_timeout_s=0.5, remote_timeout_s=5.0)
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            assert not run_job(tier, keys(2, salt=4), [0, 1], load=False).success
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        tier.shutdown()


def check_backpressure(tmp_path: Path) -> None:
    tier = build_tier(make_region(5), shared_dir=str(tmp_path / "s"), max_inflight_jobs=0)
    try:
        assert not run_job(tier, keys(1, salt=5), [0], load=False).success
        assert tier.counters["stores_refused"] == 1
    finally:
        tier.shutdown()


def build_manager(**extra: Any) -> TieringOffloadingManager:
    """vLLM's tiering manager over its own CPU primary tier (a /dev/shm region), with this tier."""
    region = SharedOffloadRegion(f"kvmesh-tier-{uuid.uuid4().hex}", CHUNKS, None, ROW_BYTES, ROW_BYTES)
    primary = CPUPrimaryTierOffloadingManager(num_chunks=CHUNKS, mmap_region=region)
    config = {
        "type": "KVMeshSecondaryTier",
        "module_path": "kvmesh.integrations.vllm_tier",
        "model": "m",
        **extra,
    }
    tier = SecondaryTierFactory.create_secondary_tier(config, primary.get_kv_memoryview(), SimpleNamespace())  # type: ignore[arg-type]
    return TieringOffloadingManager(primary, [tier])


def step_until(manager: TieringOffloadingManager, done: Any) -> None:
    end = ScheduleEndContext((), ())
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, "vLLM's tiering manager did not settle"
        manager.on_schedule_end(end)
        time.sleep(0.01)


def check_manager_round_trip(backend: dict[str, Any]) -> None:
    """vLLM's TieringOffloadingManager cascades a stored chunk into the tier; a second manager on
    another region finds it, promotes it into its CPU tier, and vLLM's load reads the same bytes."""
    writer, reader = build_manager(**backend), build_manager(**backend)
    ks = keys(3, salt=11)
    try:
        ctx = ReqContext("writer")
        writer.on_new_request(ctx)
        prepared = writer.prepare_store(ks, ctx)
        assert prepared is not None and list(prepared.keys_to_store) == ks
        src = [int(b) for b in np.asarray(prepared.store_spec.block_ids)]
        rows_w = np.asarray(writer.primary_tier.get_kv_memoryview())
        rows_w[src] = make_region(6)[: len(src)]  # vLLM's GPU->CPU copy
        writer.complete_store(ks, ctx, True)
        step_until(writer, lambda: not writer.has_pending_work())
        events = list(writer.take_events())
        assert any(
            e.locality is not None and e.locality.value == "REMOTE" and list(e.keys) == ks for e in events
        )
        writer.on_request_finished(ctx)

        rctx = ReqContext("reader")
        reader.on_new_request(rctx)
        step_until(reader, lambda: all(reader.lookup(k, rctx) is LookupResult.HIT for k in ks))
        spec = reader.prepare_load(ks, rctx)
        dst = [int(b) for b in np.asarray(spec.block_ids)]  # type: ignore[attr-defined]
        rows_r = np.asarray(reader.primary_tier.get_kv_memoryview())
        assert all(bytes(rows_r[d]) == bytes(rows_w[s]) for s, d in zip(src, dst, strict=True))
        reader.complete_load(ks, rctx)
        reader.on_request_finished(rctx)
        del rows_w, rows_r
    finally:
        writer.shutdown()
        reader.shutdown()


def check_store_yaml(tmp_path: Path, valkey_url: str) -> None:
    """The tier reads the store YAML the connector uses (its RAM tier left to vLLM) and the fleet's
    HMAC key from KVMESH_HMAC_KEY; a server with another key loads nothing."""
    store = tmp_path / "store.yaml"
    store.write_text(f"local_cpu: true\nmax_local_cpu_size: 20\nremote_url: {valkey_url}\n")
    os.environ["KVMESH_HMAC_KEY"] = "fleet-key"
    region = make_region(8)
    writer, reader = build_tier(region, store=str(store)), build_tier(np.zeros_like(region), store=str(store))
    os.environ["KVMESH_HMAC_KEY"] = "another-key"
    stranger = build_tier(np.zeros_like(region), store=str(store))
    try:
        assert not writer._config.local_cpu and writer._config.remote_url == valkey_url
        ks = keys(2, salt=8)
        assert run_job(writer, ks, [0, 1], load=False).success
        assert run_job(reader, ks, [2, 3], load=True).success
        assert not run_job(stranger, ks, [2, 3], load=True).success
    finally:
        for tier in (writer, reader, stranger):
            tier.shutdown()


def check_events_wire(tmp_path: Path) -> None:
    """The tier's events as vLLM publishes them: through the offloading connector's event tracker
    (its default, placeholder payloads) into vLLM's KVEventBatch, msgpack-encoded as its ZMQ
    publisher sends them. Prints the payload (base64) for the router side of the test."""
    tier = build_tier(make_region(9), shared_dir=str(tmp_path / "events"))
    try:
        block_hashes = [bytes([0xAB, i]) * 16 for i in range(2)]
        ks = [make_offload_key(h, 0) for h in block_hashes]
        assert run_job(tier, ks, [0, 1], load=False).success
        tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))
        events = list(tracker.take_events(tier.take_events()))
        assert events and all(e.medium == "STORAGE" and e.locality == "REMOTE" for e in events)
        payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=events))
        print("payload", base64.b64encode(payload).decode())
    finally:
        tier.shutdown()


def run_check(name: str, workdir: str, valkey_url: str = "", pid: int = 0) -> None:
    tmp = Path(workdir)
    tmp.mkdir(parents=True, exist_ok=True)
    checks = {
        "share_valkey": lambda: check_share({"remote_url": valkey_url}),
        "share_shared_dir": lambda: check_share({"shared_dir": str(tmp / "shared")}),
        "manager_valkey": lambda: check_manager_round_trip({"remote_url": valkey_url}),
        "manager_shared_dir": lambda: check_manager_round_trip({"shared_dir": str(tmp / "mgr")}),
        "store_yaml": lambda: check_store_yaml(tmp, valkey_url),
        "events_wire": lambda: check_events_wire(tmp),
        "corrupt_and_missing": lambda: check_corrupt_and_missing(tmp),
        "dead_server": lambda: check_dead_server(valkey_url),
        "slow_server": lambda: check_slow_server(valkey_url, pid),
        "backpressure": lambda: check_backpressure(tmp),
    }
    checks[name]()


def main(spec_path: str, results_path: str) -> None:
    """Runs each check of the spec in turn; one failing check does not stop the others."""
    results: dict[str, dict[str, Any]] = {}
    for spec in json.loads(Path(spec_path).read_text()):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                run_check(spec["check"], spec["workdir"], spec.get("url", ""), int(spec.get("pid", 0)))
        except BaseException:
            results[spec["check"]] = {"ok": False, "output": out.getvalue(), "error": traceback.format_exc()}
        else:
            results[spec["check"]] = {"ok": True, "output": out.getvalue(), "error": ""}
        Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
