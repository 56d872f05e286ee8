"""Cost of the vLLM connector's save and load paths, against a plain copy.

    .venv/bin/python benchmarks/integrations_transfer.py [--tokens 1024] [--layers 32] [--heads 8]
        [--head-dim 128] [--block-size 16] [--chunk-size 256] [--trials 5] [--store memory|shared]
        [--device cpu|cuda] [--json]

A paged cache shaped like one Llama-3.1-8B worker (bf16, FlashAttention layout) holds one prompt
in scattered blocks. Each trial, side by side on the same data:

    copy   torch.clone of the prompt's KV bytes (one contiguous tensor)   the floor
    save   PagedKVTransfer.save: gather from the blocks + bf16→uint16 + store write (RAM tier
           written before the call returns; slower tiers drained before timing stops)
    load   PagedKVTransfer.load into other blocks of a second cache: store retrieve + scatter

and the loaded KV is checked bit for bit against the source. Reported: medians and each path as a
multiple of ``copy``. With ``--device cuda`` the paged caches live on the GPU (as vLLM's do): save
adds the device→host copy, load the host→device one (page-locked staging), and ``copy`` is a
device-memory clone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table

from kvmesh.core.hashing import Namespace
from kvmesh.integrations.paged_kv import PagedLayout, detect_geometry, gather, token_slots
from kvmesh.integrations.paged_transfer import PagedKVTransfer
from kvmesh.integrations.request_tracker import LoadSpec, SaveSpec
from kvmesh.integrations.store_bridge import StoreBridge
from kvmesh.store.config import StoreConfig


def _cache(
    layers: int, blocks: int, block_size: int, heads: int, head_dim: int, device: str
) -> list[torch.Tensor]:
    shape = (2, blocks, block_size, heads, head_dim)
    return [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(layers)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--store", default="memory", help="memory | shared (a temporary shared directory)")
    parser.add_argument("--device", default="cpu", help="where the paged caches live: cpu | cuda")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    if args.tokens % args.chunk_size:
        parser.error("--tokens must be a multiple of --chunk-size")

    n_blocks = args.tokens // args.block_size
    total_blocks = 2 * n_blocks + 1
    src_layers = _cache(args.layers, total_blocks, args.block_size, args.heads, args.head_dim, args.device)
    dst_layers = _cache(args.layers, total_blocks, args.block_size, args.heads, args.head_dim, args.device)
    geometry = detect_geometry(src_layers[0], args.block_size)
    assert geometry.layout is PagedLayout.KV_FIRST
    gen = torch.Generator().manual_seed(0)
    src_blocks = tuple(torch.randperm(total_blocks, generator=gen)[:n_blocks].tolist())
    dst_blocks = tuple(torch.randperm(total_blocks, generator=gen)[:n_blocks].tolist())
    for layer in src_layers:
        layer.copy_(torch.randn(layer.shape, generator=gen).to(torch.bfloat16))
    sync()
    slots = token_slots(src_blocks, args.block_size, 0, args.tokens)
    reference = gather(src_layers, geometry, slots)
    nbytes = reference.numel() * reference.element_size()

    with tempfile.TemporaryDirectory() as tmp:
        config = StoreConfig(
            chunk_size=args.chunk_size,
            max_local_cpu_size=max(1.0, 4 * nbytes / 2**30),
            shared_dir=tmp if args.store == "shared" else None,
        )
        rows: dict[str, list[float]] = {"copy": [], "save": [], "load": []}
        for trial in range(args.trials):
            with (
                StoreBridge(config, retrieve_timeout_s=60.0) as writer,
                StoreBridge(config, retrieve_timeout_s=60.0) as reader,
            ):
                ns = Namespace("bench", tenant=str(trial), kv_dtype="bfloat16", kv_layout="bench")
                prompt = tuple(range(trial * 7, trial * 7 + args.tokens))
                src = PagedKVTransfer(src_layers, geometry, writer)
                # shared: the reader loads from the directory; memory: the writer's own RAM tier
                dst = PagedKVTransfer(dst_layers, geometry, reader if args.store == "shared" else writer)

                sync()
                t0 = time.perf_counter()
                reference.clone()
                sync()
                rows["copy"].append(time.perf_counter() - t0)

                t0 = time.perf_counter()
                assert src.save(SaveSpec("r", prompt, src_blocks, 0, args.tokens, ns))
                assert writer.drain(120.0)
                rows["save"].append(time.perf_counter() - t0)

                t0 = time.perf_counter()
                failed = dst.load(LoadSpec("r", prompt, dst_blocks, 0, args.tokens, ns))
                sync()
                rows["load"].append(time.perf_counter() - t0)
                assert not failed, f"load missed blocks {sorted(failed)[:5]}"
                loaded = gather(
                    dst_layers, geometry, token_slots(dst_blocks, args.block_size, 0, args.tokens)
                )
                assert torch.equal(loaded.view(torch.int16), reference.view(torch.int16)), "loaded KV differs"

    medians = {k: statistics.median(v) for k, v in rows.items()}
    report = {
        "tokens": args.tokens,
        "layers": args.layers,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "store": args.store,
        "device": args.device,
        "kv_mib": nbytes / 2**20,
        "trials": args.trials,
        "median_s": medians,
        "vs_copy": {k: medians[k] / medians["copy"] for k in ("save", "load")},
        "gib_per_s": {k: nbytes / 2**30 / v for k, v in medians.items()},
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    title = f"{args.tokens} tokens, {nbytes / 2**20:.0f} MiB of bf16 KV, store={args.store}, {args.device}"
    table = Table(title=title)
    for col in ("path", "median ms", "GiB/s", "× copy"):
        table.add_column(col, justify="right")
    for name in ("copy", "save", "load"):
        ratio = "1.0" if name == "copy" else f"{report['vs_copy'][name]:.1f}"  # type: ignore[index]
        table.add_row(name, f"{medians[name] * 1e3:.1f}", f"{report['gib_per_s'][name]:.2f}", ratio)  # type: ignore[index]
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
