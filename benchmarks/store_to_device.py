"""A stored prefix into device memory, stage by stage: read from a shared directory, then copy to the device.

    python benchmarks/store_to_device.py [--tokens 16384] [--shape llama-3.1-8b] [--device cuda]
        [--dir /dev/shm] [--trials 3] [--json]

One prompt's KV (random bf16 values of the shape) is written once into a shared-directory store; each
trial then loads it the way an engine does, with a fresh reader and no RAM tier, so every byte comes
from the directory:

    read     KVCacheEngine.retrieve(join=False): the chunk files, checksums verified
             mapped (the default on a memory-backed directory) and copied (elsewhere), side by side
    device   DeviceKVOps.join_host of the mapped chunks: through page-locked staging buffers on a copy
             stream (the default on CUDA) and straight from pageable memory, side by side
    total    mapped read + the default device copy

GB/s are of the KV bytes. Medians over ``--trials``; the alternatives alternate within each trial, so
drifts in machine load fall on both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch

from kvmesh.core.hashing import Namespace
from kvmesh.engine.torch_runner import DeviceKVOps
from kvmesh.store.bench import SHAPES
from kvmesh.store.cache_engine import KVCacheEngine
from kvmesh.store.config import StoreConfig

NAMESPACE = Namespace("store-to-device")


def reader(shared: str, mapped: bool, chunk_bytes: int) -> KVCacheEngine:
    store = KVCacheEngine.from_config(
        StoreConfig(local_cpu=False, shared_dir=shared, kv_dtype="bfloat16", mmap_reads=mapped)
    )
    store.tiered.expect_chunk_bytes(chunk_bytes)
    return store


async def timed_read(shared: str, mapped: bool, tokens: list[int], chunk_bytes: int) -> tuple[float, Any]:
    store = reader(shared, mapped, chunk_bytes)
    try:
        start = time.perf_counter()
        loaded = await store.retrieve(tokens, NAMESPACE, join=False)
        elapsed = time.perf_counter() - start
    finally:
        await store.aclose()
    if loaded.num_tokens != len(tokens):
        raise RuntimeError(f"read {loaded.num_tokens} of {len(tokens)} tokens back")
    return elapsed, loaded.parts


def timed_join(ops: DeviceKVOps, parts: Any) -> float:
    sync = torch.cuda.synchronize if ops.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = ops.join_host(parts)
    sync()
    elapsed = time.perf_counter() - start
    del out
    return elapsed


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", default="/dev/shm", help="parent of the shared store directory")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    layers, heads, dim, _ = SHAPES[args.shape]
    tokens = list(range(args.tokens))
    kv = np.random.default_rng(0).integers(0, 1 << 16, (layers, 2, heads, args.tokens, dim), dtype=np.uint16)
    device = torch.device(args.device)
    copies = {"direct": DeviceKVOps(device, torch.bfloat16, staged=False)}
    if device.type == "cuda":
        copies["staged"] = DeviceKVOps(device, torch.bfloat16, staged=True)
    default_copy = "staged" if "staged" in copies else "direct"
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-store-to-device-", dir=args.dir) as shared:
        writer = KVCacheEngine.from_config(
            StoreConfig(local_cpu=False, shared_dir=shared, kv_dtype="bfloat16")
        )
        await writer.store(tokens, NAMESPACE, kv)
        await writer.drain()
        await writer.aclose()
        chunk_bytes = kv.nbytes // (args.tokens // writer.chunk_size)
        for ops in copies.values():  # warm-up: CUDA context, staging buffers, allocator
            _, parts = await timed_read(shared, True, tokens, chunk_bytes)
            timed_join(ops, parts)
        for trial in range(args.trials):
            row: dict[str, float] = {}
            for mapped in (trial % 2 == 0, trial % 2 != 0):
                seconds, parts = await timed_read(shared, mapped, tokens, chunk_bytes)
                row["read_mapped_s" if mapped else "read_copied_s"] = seconds
                if mapped:
                    mapped_parts = parts
            for name in sorted(copies, reverse=trial % 2 == 1):
                row[f"device_{name}_s"] = timed_join(copies[name], mapped_parts)
            row["total_s"] = row["read_mapped_s"] + row[f"device_{default_copy}_s"]
            rows.append(row)
            if not args.json:
                print(f"trial {trial + 1}: " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    gib = kv.nbytes / (1 << 30)
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    report: dict[str, Any] = {
        "shape": args.shape,
        "tokens": args.tokens,
        "kv_gib": round(gib, 3),
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "trials": rows,
        "median_s": medians,
        "gb_per_s": {k.removesuffix("_s"): kv.nbytes / v / 1e9 for k, v in medians.items()},
        "read_copied_over_mapped": medians["read_copied_s"] / medians["read_mapped_s"],
    }
    if "device_staged_s" in medians:
        report["device_direct_over_staged"] = medians["device_direct_s"] / medians["device_staged_s"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report["gb_per_s"].items():
            print(f"{key:>16}: {medians[key + '_s']:.3f} s  {value:.2f} GB/s")
        print(f"copied read / mapped read: {report['read_copied_over_mapped']:.2f}x")
        if "device_direct_over_staged" in report:
            print(f"pageable copy / staged copy: {report['device_direct_over_staged']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
