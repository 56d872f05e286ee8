"""``kvmesh store flush | stats | bench``.

``flush`` and ``stats`` open the persistent tiers of a store config (local disk, Redis/Valkey,
shared directory; a RAM tier belongs to a running engine and is not reachable from here). The
local disk tier is owned by one engine process: flush it only while that engine is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import msgspec

from kvmesh.errors import ConfigError

_CONFIG_HELP = (
    "store config: YAML path or URL (redis://…, valkey://…, file:///dir); default $KVMESH_STORE_CONFIG"
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("store", help="tiered KV store: flush, stats, bench")
    store_sub = p.add_subparsers(dest="store_command", metavar="ACTION", required=True)

    flush = store_sub.add_parser("flush", help="delete the chunks of a model/revision/LoRA (or all)")
    flush.add_argument("--config", default=None, help=_CONFIG_HELP)
    flush.add_argument("--model", default=None, help="model id whose chunks to delete")
    flush.add_argument("--revision", default="")
    flush.add_argument("--lora", default="")
    flush.add_argument("--all", action="store_true", help="delete every kvmesh chunk in the tiers")
    flush.add_argument("--json", action="store_true")
    flush.set_defaults(func=_cmd_flush)

    stats = store_sub.add_parser("stats", help="sizes, counters and breaker state of each tier")
    stats.add_argument("--config", default=None, help=_CONFIG_HELP)
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(func=_cmd_stats)

    bench = store_sub.add_parser("bench", help="put/get GB/s per tier next to same-run baselines")
    bench.add_argument(
        "--shape", default="llama-3.1-8b", help="KV shape preset (llama-3.1-8b, qwen3-0.6b, smollm2-135m)"
    )
    bench.add_argument("--chunk-tokens", type=int, default=256)
    bench.add_argument(
        "--chunks", type=int, default=4, dest="num_chunks", metavar="CHUNKS", help="chunks per batch"
    )
    bench.add_argument("--iterations", type=int, default=5)
    bench.add_argument("--codec", default="raw", help="raw | int8 | fp8")
    bench.add_argument("--tiers", default="cpu,disk,fs,redis,valkey", help="comma-separated subset")
    bench.add_argument("--redis-url", default=None, help="use this server instead of starting redis-server")
    bench.add_argument("--valkey-url", default=None, help="use this server instead of starting valkey-server")
    bench.add_argument(
        "--dir",
        default=None,
        dest="workdir",
        metavar="DIR",
        help="directory for the disk and fs tiers (default: a temp dir)",
    )
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=_cmd_bench)


def _persistent_config(source: str | None) -> Any:
    from kvmesh.store.config import resolve_config

    config = resolve_config(source or os.environ.get("KVMESH_STORE_CONFIG"))
    return msgspec.structs.replace(config, local_cpu=False)


def _fail(message: str) -> int:
    print(f"kvmesh store: {message}", file=sys.stderr)
    return 2


def _cmd_flush(args: argparse.Namespace) -> int:
    from kvmesh.core.hashing import Namespace
    from kvmesh.store.factory import build_store
    from kvmesh.store.keys import namespace_group

    if bool(args.model) == bool(args.all):
        return _fail("give either --model (with optional --revision/--lora) or --all")
    try:
        config = _persistent_config(args.config)
    except ConfigError as exc:
        return _fail(str(exc))
    group = None if args.all else namespace_group(Namespace(args.model, args.revision, args.lora))

    async def run() -> dict[str, int | None]:
        store = build_store(config)
        try:
            return await store.flush(group)
        finally:
            await store.aclose()

    removed = asyncio.run(run())
    if not removed:
        return _fail("the config names no persistent tier (local_disk, remote_url or shared_dir)")
    if args.json:
        print(json.dumps({"group": group, "removed": removed}))
    else:
        for tier, count in removed.items():
            print(f"{tier}: {'unreachable' if count is None else f'{count} chunks removed'}")
    return 1 if any(count is None for count in removed.values()) else 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from kvmesh.store.factory import build_store

    try:
        config = _persistent_config(args.config)
    except ConfigError as exc:
        return _fail(str(exc))

    async def run() -> dict[str, object]:
        store = build_store(config)
        try:
            return await store.stats()
        finally:
            await store.aclose()

    stats = asyncio.run(run())
    stats["config"] = config.describe()
    if args.json:
        print(json.dumps(stats, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvmesh store tiers")
    for column in ("tier", "kind", "chunks", "bytes", "capacity", "evictions", "breaker"):
        table.add_column(column)
    tiers = stats["tiers"]
    assert isinstance(tiers, dict), "TieredStore.stats() returns a tiers mapping"
    for name, info in tiers.items():
        backend = info["backend"]
        if backend is None:
            table.add_row(name, "-", "unreachable", "-", "-", "-", info["breaker"])
            continue
        table.add_row(
            name,
            str(backend["kind"]),
            _count(backend["num_chunks"]),
            _count(backend["num_bytes"]),
            str(backend["capacity_bytes"] or "unbounded"),
            str(backend["num_evictions"]),
            info["breaker"],
        )
    Console().print(table)
    return 0


def _count(value: object) -> str:
    return "?" if value == -1 else str(value)


def _cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvmesh.core.cli_options import options_from_args
    from kvmesh.store.bench import BenchOptions, run_bench

    options = options_from_args(
        BenchOptions, args, tiers=tuple(t.strip() for t in args.tiers.split(",") if t.strip())
    )
    console = Console(stderr=True)
    try:
        with console.status("store bench") as status:
            report = asyncio.run(
                run_bench(options, progress=lambda tier: status.update(f"store bench: {tier}"))
            )
    except ValueError as exc:
        return _fail(str(exc))
    if args.json:
        sys.stdout.write(report.to_json().decode() + "\n")
        return 0
    table = Table(
        title=f"kvmesh store bench — {report.shape} {report.kv_shape} {report.dtype}, codec {report.codec}, "
        f"{report.num_chunks} × {report.chunk_bytes / 2**20:.1f} MiB chunks, median of {report.iterations}"
    )
    for column in ("tier", "op", "GB/s", "baseline", "baseline GB/s", "ratio"):
        table.add_column(column, justify="right" if "GB" in column or column == "ratio" else "left")
    for row in report.rows:
        table.add_row(
            row.tier, row.op, f"{row.gbps:.2f}", row.baseline, f"{row.baseline_gbps:.2f}", f"{row.ratio:.2f}"
        )
    Console().print(table)
    for tier, reason in report.skipped.items():
        console.print(f"skipped {tier}: {reason}")
    return 0
