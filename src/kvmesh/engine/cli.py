"""``kvmesh engine``: run one engine replica (real model or emulated GPU) behind the OpenAI API."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "engine",
        help="run an engine replica (OpenAI API, KV events, vLLM metrics)",
        description="Serve a model (or an emulated GPU replica) with a device-tier prefix cache.",
    )
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny-random-llama | local HF model dir")
    p.add_argument("--emulate", metavar="PRESET", help="emulate a GPU replica with this cost-model preset")
    p.add_argument("--served-model-name", help="name clients use (default: the model's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument(
        "--store",
        metavar="CONFIG_OR_URL",
        help="store config YAML or URL (memory, redis://, file:///dir); emulated engines store placeholder KV",
    )
    p.add_argument(
        "--announce-shared-writes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="publish a SHARED BlockStored when a prompt reaches a shared store tier (default on)",
    )
    p.add_argument(
        "--announce-local-tiers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="publish CPU/DISK events as the store's RAM and local disk tiers store and evict (default on)",
    )
    p.add_argument(
        "--events", metavar="ENDPOINT", help="ZMQ PUB endpoint for KV events, e.g. tcp://127.0.0.1:5557"
    )
    p.add_argument("--events-replay", metavar="ENDPOINT", help="ZMQ ROUTER endpoint for event replay")
    p.add_argument(
        "--events-topic",
        metavar="TOPIC",
        help="first frame of every KV event message (default kv-events; vLLM publishes '')",
    )
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--kv-capacity-tokens", type=int)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hash-algo", default="sha256", choices=["sha256", "xxh3"])
    p.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--max-model-len", type=int)
    p.add_argument(
        "--stream-interval", type=float, help="seconds between stream flushes after the first token"
    )
    p.add_argument("--num-threads", type=int, help="torch CPU threads")
    p.add_argument("--list-presets", action="store_true", help="print the emulation presets and exit")
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=_run)


def _list_presets() -> int:
    from rich.console import Console
    from rich.table import Table

    from kvmesh.engine.cost_model import PRESETS, CostModel

    table = Table(title="emulation presets")
    for col in ("preset", "model", "GPU × TP", "KV tokens", "cold 7.2k TTFT s", "decode step (32×8k) ms"):
        table.add_column(col)
    for name, preset in PRESETS.items():
        cost = CostModel(preset)
        table.add_row(
            name,
            preset.model.name,
            f"{preset.gpu.name} × {preset.tp}",
            f"{cost.kv_capacity_tokens():,}",
            f"{cost.cold_prefill_time(7200):.3f}",
            f"{cost.decode_step_time([8000] * 32) * 1e3:.1f}",
        )
    Console().print(table)
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.list_presets:
        return _list_presets()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from kvmesh.core.cli_options import options_from_args
    from kvmesh.core.event_transport import DEFAULT_TOPIC
    from kvmesh.core.tenancy import Role
    from kvmesh.engine.app import EngineOptions, build_engine
    from kvmesh.errors import KVMeshError

    opts = options_from_args(
        EngineOptions,
        args,
        events_topic=DEFAULT_TOPIC if args.events_topic is None else args.events_topic,
        role=Role(args.role),
    )

    async def main() -> None:
        server = await build_engine(opts)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        port = await server.start(args.host, args.port)
        ready = {"url": f"http://{args.host}:{port}", **server.info_dict()}
        print(json.dumps(ready), flush=True)
        try:
            await stop.wait()
        finally:
            await server.stop()

    try:
        asyncio.run(main())
    except (KVMeshError, ValueError, OSError) as exc:
        print(f"kvmesh engine: {exc}", file=sys.stderr)
        return 1
    return 0
