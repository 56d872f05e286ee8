"""``kvmesh router``: run the cache-aware gateway; ``kvmesh prewarm``: compute documents' KV through one.

``kvmesh router --config router.yaml`` or, for the common case,
``kvmesh router --endpoints http://127.0.0.1:8001,http://127.0.0.1:8002 --policy precise``.
Flags override the file.

``kvmesh prewarm --url http://127.0.0.1:8000 docs.jsonl manuals/ --template "...{document}..."``
(see :mod:`kvmesh.router.prewarm_client`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import TYPE_CHECKING

from kvmesh.errors import ConfigError, KVMeshError

if TYPE_CHECKING:
    from kvmesh.router.config import RouterConfig
    from kvmesh.router.ingest_split import IngestSplit

_POLICIES = ("precise", "llmd-precise", "approximate", "load", "random", "round-robin", "pd")
"""The scheduler presets (kept here so `--help` needs no scheduler import; a test checks they agree)."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("router", help="run the KV-cache-aware OpenAI gateway")
    p.add_argument("--config", default=None, help="router YAML file (see docs/router.md)")
    p.add_argument("--endpoints", default=None, help="comma-separated engine base URLs")
    p.add_argument("--policy", choices=_POLICIES, default=None, help="scheduling preset")
    p.add_argument("--scheduler-config", default=None, help="scheduler YAML (plugins + schedulingProfiles)")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--model", default=None, help="namespace model name (default: from the engines)")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec, e.g. smollm2 or a model directory")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--hash-algo", choices=["sha256", "xxh3"], default=None)
    p.add_argument("--redis-index", default=None, metavar="URL", help="share the index through Redis/Valkey")
    p.add_argument(
        "--max-connections-per-endpoint",
        type=int,
        default=None,
        metavar="N",
        help="connections open to one engine for requests (upstream.maxConnectionsPerEndpoint; default 1024)",
    )
    p.add_argument(
        "--admin-token", default=None, help="bearer token of /admin/* (or $KVMESH_ROUTER_ADMIN_TOKEN)"
    )
    p.add_argument(
        "--loop",
        choices=("auto", "uvloop", "asyncio"),
        default="auto",
        help="event loop (auto: uvloop where installed, else asyncio's)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="gateway processes sharing the port (SO_REUSEPORT), one per core to use (default 1)",
    )
    p.add_argument(
        "--split-events",
        action="store_true",
        help="with --workers N: each engine's KV events are ingested by one worker, which sends the "
        "index writes to the others (cheaper to apply than the events; in-process index only)",
    )
    p.add_argument(
        "--aiohttp-only",
        action="store_true",
        help="serve every route on aiohttp (default: the completion routes on the router's own HTTP "
        "front, cheaper per request, and the rest on aiohttp behind it)",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_cmd_router)
    _register_prewarm(sub)


def _register_prewarm(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "prewarm",
        help="compute documents' KV once through a router, so every endpoint serves them from cache",
    )
    p.add_argument(
        "files", nargs="+", metavar="FILE", help="JSONL files, text files, directories of text files"
    )
    p.add_argument("--url", required=True, help="the router's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--template", default=None, help='prompt around each text document: "...{document}..."')
    p.add_argument("--tenant", default=None, help="tenant (sent as x-tenant-id)")
    p.add_argument("--model", default=None, help="model name the requests use")
    p.add_argument("--lora", default=None, help="LoRA adapter name (the model name its requests use)")
    p.add_argument(
        "--ttl-s", type=float, default=None, help="keep each prefix pinned this long (kvmesh.cache_ttl_s)"
    )
    p.add_argument("--batch", type=int, default=16, metavar="N", help="documents per request to the router")
    p.add_argument("--concurrency", type=int, default=4, help="documents the router computes at once")
    p.add_argument(
        "--timeout-s", type=float, default=60.0, help="per document: wait this long for the shared tier"
    )
    p.add_argument(
        "--no-wait", action="store_true", help="report once computed; do not wait for the shared tier"
    )
    p.add_argument("--store-chunk-tokens", type=int, default=256, help="the store's chunk size (default 256)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_prewarm)


def _cmd_prewarm(args: argparse.Namespace) -> int:
    import msgspec
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvmesh.router.prewarm_client import (
        PrewarmOptions,
        load_documents,
        num_failed,
        prewarm_documents,
        report_table,
    )

    if args.lora is not None and args.model is not None and args.lora != args.model:
        print("kvmesh prewarm: give --lora or --model, not both", file=sys.stderr)
        return 2
    if args.batch < 1:
        print("kvmesh prewarm: --batch must be >= 1", file=sys.stderr)
        return 2
    try:
        documents = load_documents(args.files, args.template)
    except (OSError, ValueError) as exc:
        print(f"kvmesh prewarm: {exc}", file=sys.stderr)
        return 2
    options = PrewarmOptions(
        url=args.url,
        model=args.lora if args.lora is not None else args.model,
        tenant=args.tenant,
        ttl_s=args.ttl_s,
        batch=args.batch,
        concurrency=args.concurrency,
        wait_for_shared=not args.no_wait,
        timeout_s=args.timeout_s,
        store_chunk_tokens=args.store_chunk_tokens,
    )
    stderr = Console(stderr=True)
    progress = Progress(
        TextColumn("prewarm"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=stderr, transient=True, disable=len(documents) <= args.batch,
    )  # fmt: skip
    with progress:
        task = progress.add_task("prewarm", total=len(documents))
        response = asyncio.run(
            prewarm_documents(documents, options, lambda got: progress.advance(task, len(got)))
        )
    if args.json:
        sys.stdout.write(msgspec.json.encode(response).decode() + "\n")
    else:
        Console().print(report_table(response))
    return 1 if num_failed(response) else 0


def _cmd_router(args: argparse.Namespace) -> int:
    import yaml

    if args.workers < 1:
        print(f"kvmesh router: --workers must be >= 1, got {args.workers}", file=sys.stderr)
        return 2
    try:
        config = _config_from_args(args)
        if args.workers > 1:
            new_event_loop(args.loop)  # an unavailable --loop is reported once, here
    except (KVMeshError, yaml.YAMLError) as exc:
        print(f"kvmesh router: {exc}", file=sys.stderr)
        return 2
    if not config.endpoints and not config.discovery and not config.pools:
        print(
            "kvmesh router: no endpoints (give --endpoints, or endpoints: or discovery: in --config)",
            file=sys.stderr,
        )
        return 2
    if args.split_events and (args.workers < 2 or config.index.backend != "memory"):
        print(
            "kvmesh router: --split-events needs --workers 2 or more and the in-process index",
            file=sys.stderr,
        )
        return 2
    if args.workers > 1 and config.port == 0:
        print(
            "kvmesh router: --workers needs a fixed --port (port 0 would give each its own)", file=sys.stderr
        )
        return 2
    followed = "".join(f", following {d.service}" for d in config.discovery)
    if config.pools:
        followed = f" in pools {', '.join(p.name for p in config.pools)}"
    if args.workers == 1:
        return _serve(args, reuse_port=False, banner=f"{len(config.endpoints)} endpoints{followed}")
    import functools
    import shutil
    import tempfile

    from kvmesh.router.workers import WorkerSupervisor

    split = " splitting event ingestion" if args.split_events else ""
    print(
        f"kvmesh router on http://{config.host}:{config.port} ({args.workers} workers{split}) → {len(config.endpoints)} endpoints{followed}",
        file=sys.stderr,
    )
    # The workers' own sockets (their peers reach each by one) and those of split ingestion, in a
    # private directory with a short path (unix socket paths are limited to ~100 bytes).
    sockets = tempfile.mkdtemp(prefix="kvmesh-router-")
    try:
        return WorkerSupervisor(functools.partial(_serve_worker, args, sockets), args.workers).run()
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def _serve_worker(args: argparse.Namespace, sockets: str, index: int) -> None:
    """One of ``--workers N`` (in a spawned process): a whole gateway on the shared port."""
    from kvmesh.router.ingest_split import IngestSplit

    split = IngestSplit(index, args.workers, sockets) if args.split_events else None
    sys.exit(_serve(args, reuse_port=True, banner=None, ingest_split=split, worker=(index, sockets)))


def _serve(
    args: argparse.Namespace,
    *,
    reuse_port: bool,
    banner: str | None,
    ingest_split: IngestSplit | None = None,
    worker: tuple[int, str] | None = None,
) -> int:
    """Build the gateway from ``args`` and serve it until SIGINT/SIGTERM."""
    import yaml

    from kvmesh.router.gateway import Gateway
    from kvmesh.router.pools import PooledRouter, load_pool_tokenizers
    from kvmesh.router.tokenize import PromptTokenizer

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = _config_from_args(args)
        router: Gateway | PooledRouter
        if config.pools:
            router = PooledRouter(config, tokenizers=load_pool_tokenizers(config), ingest_split=ingest_split)
        else:
            tokenizer: PromptTokenizer | None = None
            if config.tokenizer:
                from kvmesh.core.tokens import Tokenizer

                tokenizer = Tokenizer.load(config.tokenizer)
            router = Gateway(config, tokenizer=tokenizer, ingest_split=ingest_split)
        app = router.app
        mesh = None
        if worker is not None:
            from kvmesh.router.worker_mesh import WorkerMesh

            configured = (
                {f"/pools/{p.name}": [e.url for e in p.endpoints] for p in config.pools}
                if config.pools
                else {"": [e.url for e in config.endpoints]}
            )
            mesh = WorkerMesh(
                worker[0], args.workers, worker[1], admin_token=config.admin_token, configured=configured
            )
            mesh.install(app)
        loop = new_event_loop(args.loop)
    except (KVMeshError, yaml.YAMLError) as exc:
        print(f"kvmesh router: {exc}", file=sys.stderr)
        return 2
    if banner is not None:
        print(f"kvmesh router on http://{config.host}:{config.port} → {banner}", file=sys.stderr)
    from kvmesh.router.gc_tuning import tune_for_serving

    tune_for_serving()
    from kvmesh.router.serving import DRAIN_S, serve_until_signalled

    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(
            serve_until_signalled(
                app,
                config.host,
                config.port,
                reuse_port=reuse_port,
                drain_s=DRAIN_S if reuse_port else 0.0,
                unix_path=None if mesh is None else mesh.socket_path,
                front_routes=None if args.aiohttp_only else router.front_routes(),
                max_body_bytes=config.max_body_bytes,
            )
        )
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    return 0


def _config_from_args(args: argparse.Namespace) -> RouterConfig:
    import msgspec

    from kvmesh.router.config import RouterConfig, load_router_config
    from kvmesh.router.endpoints import EndpointConfig
    from kvmesh.router.scheduler import load_scheduler_config

    config = load_router_config(args.config) if args.config else RouterConfig()
    updates: dict[str, object] = {}
    if args.endpoints:
        updates["endpoints"] = [EndpointConfig(url=u) for u in args.endpoints.split(",") if u.strip()]
    if args.policy:
        updates["policy"] = args.policy
        updates["scheduler"] = None
    if args.scheduler_config:
        updates["scheduler"] = load_scheduler_config(args.scheduler_config)
    for flag, field in (
        ("host", "host"),
        ("port", "port"),
        ("model", "model"),
        ("tokenizer", "tokenizer"),
        ("block_size", "block_size"),
        ("hash_algo", "hash_algo"),
        ("admin_token", "admin_token"),
        ("seed", "seed"),
    ):
        value = getattr(args, flag)
        if value is not None:
            updates[field] = value
    if args.redis_index:
        updates["index"] = msgspec.structs.replace(config.index, backend="redis", redis_url=args.redis_index)
    if args.max_connections_per_endpoint is not None:
        updates["upstream"] = msgspec.structs.replace(
            config.upstream, max_connections_per_endpoint=args.max_connections_per_endpoint
        )
    config = msgspec.structs.replace(config, **updates)
    config.__post_init__()
    return config


def new_event_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    """A fresh event loop: uvloop's (libuv; about a third less CPU per proxied request) or asyncio's.

    Args:
        kind: ``auto`` (uvloop where it imports), ``uvloop`` or ``asyncio``.

    Raises:
        ConfigError: ``uvloop`` was asked for and is not installed.
    """
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError as exc:
            if kind == "uvloop":
                raise ConfigError(f"--loop uvloop: uvloop is not installed ({exc})") from exc
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()
