"""``kvmesh hash`` and ``kvmesh events decode|listen``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import Any

from kvmesh.core.events import KVEventBatch, decode_batch, event_to_json_dict
from kvmesh.core.hashing import DEFAULT_BLOCK_SIZE, BlockHasher, HashAlgo, Namespace
from kvmesh.core.tasks import cancel_and_wait
from kvmesh.core.types import PodId
from kvmesh.core.vllm_hashing import to_wire_u64, vllm_block_hashes
from kvmesh.errors import ProtocolError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "hash",
        help="print one block hash per full block of TOKEN...",
        description=(
            "Print one block hash per full block of TOKEN... With --algo kvmesh or xxh3: kvmesh's own "
            "chained keys (hex). With --algo vllm-sha256-cbor: the hashes vLLM 0.32 ("
            "prefix_caching_hash_algo=sha256_cbor) computes for the same prompt, as its KV events "
            "carry them (u64 by default, or --format hex for the 32 raw bytes)."
        ),
    )
    p.add_argument("tokens", nargs="+", type=int, metavar="TOKEN")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--algo", choices=["kvmesh", "xxh3", "vllm-sha256-cbor"], default="kvmesh")
    p.add_argument(
        "--seed",
        default=None,
        help="vllm: NONE_HASH seed, i.e. the vLLM process's PYTHONHASHSEED (an empty string is a seed); "
        "default: this shell's PYTHONHASHSEED if set, else vLLM's fixed 'vllm-none-hash'",
    )
    p.add_argument(
        "--extra-key",
        action="append",
        default=[],
        dest="extra_keys",
        help="vllm: explicit extra key for every block, used as given (repeatable); "
        "overrides --lora/--lora-path/--cache-salt",
    )
    p.add_argument(
        "--lora", default="", help="LoRA name (kvmesh/xxh3: part of the namespace; vllm: LoRA extra key)"
    )
    p.add_argument(
        "--lora-path",
        default=None,
        help="vllm: the LoRA adapter's path (vLLM 0.32 hashes name and path; required with --lora)",
    )
    p.add_argument("--cache-salt", default=None, help="vllm: the request's cache_salt (block 0 extra key)")
    p.add_argument(
        "--legacy-extra-keys",
        action="store_true",
        help="vllm: older vLLM's untagged extra keys (bare LoRA name, then salt; no path)",
    )
    p.add_argument(
        "--format",
        choices=["u64", "hex"],
        default="u64",
        help="vllm: u64 as KV events carry it with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (vLLM's default), "
        "or the 32-byte hash in hex",
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--revision", default="")
    p.add_argument("--tenant", default="")
    p.set_defaults(func=_cmd_hash)

    mdl = sub.add_parser(
        "model",
        help="prepare a model directory (the bundled SmolLM2, converted once) and print its path",
        description="Convert the model once into the kvmesh cache (offline) and print the directory; "
        "vLLM, tokenizer-based tools and the engine all serve it.",
    )
    mdl.add_argument(
        "spec", nargs="?", default="smollm2", help="smollm2 (default), tiny, or a model directory"
    )
    mdl.add_argument("--json", action="store_true", help="print path, name and revision as JSON")
    mdl.set_defaults(func=_cmd_model)

    ev = sub.add_parser("events", help="decode or listen to vLLM-format KV events")
    ev_sub = ev.add_subparsers(dest="events_command", metavar="ACTION", required=True)
    dec = ev_sub.add_parser("decode", help="decode raw msgpack batch payload files")
    dec.add_argument("files", nargs="+", type=Path, metavar="FILE")
    dec.set_defaults(func=_cmd_decode)
    lis = ev_sub.add_parser("listen", help="print live events from ZMQ publishers")
    lis.add_argument(
        "endpoints", nargs="+", metavar="ENDPOINT", help="tcp://host:port[,replay=tcp://host:port]"
    )
    lis.add_argument("--topic", default="")
    lis.add_argument(
        "--count", type=int, default=0, help="exit after this many events (0 = run until Ctrl-C)"
    )
    lis.add_argument("--timeout", type=float, default=0.0, help="exit after this many seconds (0 = no limit)")
    lis.set_defaults(func=_cmd_listen)


def _cmd_model(args: argparse.Namespace) -> int:
    from kvmesh.core.models import resolve_model
    from kvmesh.errors import ModelLoadError

    try:
        files = resolve_model(args.spec)
    except ModelLoadError as exc:
        print(f"kvmesh model: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"path": str(files.path), "name": files.name, "revision": files.revision}))
    else:
        print(files.path)
    return 0


def _cmd_hash(args: argparse.Namespace) -> int:
    if args.algo == "vllm-sha256-cbor":
        if args.lora_path and not args.lora:
            print("kvmesh hash: --lora-path needs --lora (the LoRA name)", file=sys.stderr)
            return 2
        try:
            hashes = vllm_block_hashes(
                args.tokens,
                args.block_size,
                seed=args.seed,
                lora_name=args.lora or None,
                lora_path=args.lora_path,
                cache_salt=args.cache_salt,
                extra_keys=args.extra_keys or None,
                legacy_extra_keys=args.legacy_extra_keys,
            )
        except ValueError as exc:
            print(f"kvmesh hash: {exc}", file=sys.stderr)
            return 2
        for h in hashes:
            print(to_wire_u64(h) if args.format == "u64" else h.hex())
        return 0
    algo = HashAlgo.XXH3 if args.algo == "xxh3" else HashAlgo.SHA256
    ns = Namespace(args.model, args.revision, args.lora, args.tenant)
    for key in BlockHasher(ns, args.block_size, algo).hash_blocks(args.tokens):
        print(key.hex())
    return 0


def _print_batch(batch: KVEventBatch, pod: str | None = None) -> int:
    for event in batch.events:
        record: dict[str, Any] = event_to_json_dict(event)
        if pod is not None:
            record["pod"] = pod
        sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()
    return len(batch.events)


def _cmd_decode(args: argparse.Namespace) -> int:
    status = 0
    for path in args.files:
        try:
            batch = decode_batch(path.read_bytes())
        except (OSError, ProtocolError) as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            status = 1
            continue
        _print_batch(batch)
    return status


def _parse_endpoint(text: str) -> tuple[str, str | None]:
    endpoint, _, rest = text.partition(",")
    replay = None
    if rest:
        key, _, value = rest.partition("=")
        if key != "replay" or not value:
            raise SystemExit(f"bad endpoint {text!r}: expected tcp://host:port[,replay=tcp://host:port]")
        replay = value
    return endpoint, replay


def _cmd_listen(args: argparse.Namespace) -> int:
    from kvmesh.core.event_transport import ZmqEventSubscriber

    async def listen() -> int:
        seen = 0
        done = asyncio.Event()

        def on_batch(pod: PodId, seq: int, batch: KVEventBatch) -> None:
            nonlocal seen
            seen += _print_batch(batch, pod)
            if args.count and seen >= args.count:
                done.set()

        def on_reset(pod: PodId) -> None:
            print(json.dumps({"type": "PublisherRestarted", "pod": pod}), flush=True)

        sub = ZmqEventSubscriber(on_batch, on_reset, topic=args.topic)
        for text in args.endpoints:
            endpoint, replay = _parse_endpoint(text)
            sub.add_publisher(PodId(endpoint), endpoint, replay)
        task = asyncio.create_task(sub.run())
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signal.SIGINT, done.set)
            loop.add_signal_handler(signal.SIGTERM, done.set)
        try:
            await asyncio.wait_for(done.wait(), args.timeout or None)
        except TimeoutError:
            pass
        await sub.aclose()
        await cancel_and_wait([task])
        stats = sub.stats
        print(
            f"events={stats.num_events} batches={stats.num_batches} malformed={stats.num_malformed} "
            f"gaps={stats.num_gaps} replayed={stats.num_replayed} resets={stats.num_resets}",
            file=sys.stderr,
        )
        return 0

    return asyncio.run(listen())
