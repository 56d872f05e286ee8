"""Assemble an engine from options: runner, tokenizer, prefix cache, store, event publisher, server.

Used by ``kvmesh engine`` and by anything that runs engines in-process (tests, ``kvmesh up``)::

    server = await build_engine(EngineOptions(model="tiny-random-llama", emulate="tiny-h100"))
    port = await server.start("127.0.0.1", 0)
    ...
    await server.stop()          # also closes the publisher and the store
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvmesh.core.event_transport import (
    DEFAULT_TOPIC,
    EventPublisher,
    NullEventPublisher,
    ZmqEventPublisher,
)
from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace
from kvmesh.core.tenancy import Role
from kvmesh.core.tokens import Tokenizer
from kvmesh.engine.core import EngineCore, SchedulerConfig
from kvmesh.engine.emulated_runner import EmulatedRunner
from kvmesh.engine.prefix_cache import PrefixCache
from kvmesh.engine.runner import ModelRunner
from kvmesh.engine.server import EngineServer, ServerConfig
from kvmesh.engine.store_connector import CacheEngineStore, PrefixStore


@dataclass(slots=True)
class EngineOptions:
    """Everything ``kvmesh engine`` takes."""

    model: str = "smollm2"
    emulate: str | None = None
    """Cost-model preset; ``None`` runs the real model."""
    served_model_name: str | None = None
    store: str | None = None
    """Store config path or URL (``memory``, ``redis://…``, ``file:///dir``); ``None``: no store.
    Emulated engines store placeholder KV (:mod:`kvmesh.engine.emulated_runner`)."""
    announce_shared_writes: bool = True
    """Publish a ``"SHARED"`` BlockStored when a prompt's chunks reach a shared store tier."""
    announce_local_tiers: bool = True
    """Publish ``"CPU"``/``"DISK"`` events as the store's RAM and local disk tiers store and evict."""
    events: str | None = None
    """ZMQ PUB endpoint for KV events (``tcp://127.0.0.1:0`` picks a port)."""
    events_replay: str | None = None
    events_topic: str = DEFAULT_TOPIC
    """First frame of every event message (vllm-router's static sources subscribe to ``""``)."""
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    block_size: int = 16
    hash_algo: str = "sha256"
    role: Role = Role.BOTH
    device: str = "cpu"
    dtype: str | None = None
    max_model_len: int | None = None
    stream_interval: float | None = None
    """Seconds between stream flushes; default 0 for a real model, 0.05 emulated."""
    num_threads: int | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)


class _ClosingServer(EngineServer):
    """An EngineServer that also closes the resources ``build_engine`` opened."""

    publisher: EventPublisher
    store_closer: PrefixStore | None
    runner_closer: ModelRunner

    async def stop(self) -> None:
        await super().stop()
        self.publisher.close()
        if self.store_closer is not None:
            await self.store_closer.aclose()
        await asyncio.to_thread(self.runner_closer.close)


def _load_runner(opts: EngineOptions) -> tuple[ModelRunner, Tokenizer, str, str]:
    """The runner, the tokenizer, the namespace revision and the model directory."""
    from kvmesh.core.models import resolve_model

    files = resolve_model(opts.model)
    if opts.emulate:
        tokenizer = Tokenizer.from_dir(files.path, name=files.name)
        runner = EmulatedRunner(
            opts.emulate,
            model_name=opts.served_model_name,
            vocab_size=tokenizer.vocab_size,
            eos_token_ids=tokenizer.eos_token_ids,
            max_model_len=opts.max_model_len,
        )
        return runner, tokenizer, f"emulated:{opts.emulate}:{files.revision}", str(files.path)
    from kvmesh.engine.torch_runner import TorchRunner

    torch_runner = TorchRunner.load(
        opts.model,
        device=opts.device,
        dtype=opts.dtype,
        max_model_len=opts.max_model_len,
        num_threads=opts.num_threads,
    )
    assert torch_runner.tokenizer is not None, "TorchRunner.load returns a runner with its tokenizer"
    return torch_runner, torch_runner.tokenizer, files.revision, str(files.path)


async def build_engine(opts: EngineOptions, *, runner: ModelRunner | None = None,
                       tokenizer: Tokenizer | None = None) -> EngineServer:  # fmt: skip
    """Build a ready-to-start engine server.

    Args:
        opts: the options.
        runner: use this runner instead of loading one (with ``tokenizer``).
        tokenizer: the tokenizer that goes with ``runner``.

    Raises:
        ModelLoadError: the model or tokenizer cannot be loaded.
        ConfigError: a bad store configuration.
        ValueError: an unknown preset or inconsistent sizes.
    """
    if runner is not None and tokenizer is not None:
        the_runner, the_tokenizer = runner, tokenizer
        revision, model_path = "", ""
    else:
        the_runner, the_tokenizer, revision, model_path = await asyncio.to_thread(_load_runner, opts)
    runner, tokenizer = the_runner, the_tokenizer
    info = the_runner.info
    served = opts.served_model_name or info.model_name
    namespace = Namespace(served, revision)
    hasher = BlockHasher(namespace, opts.block_size, HashAlgo(opts.hash_algo))
    defaults = runner.engine_defaults()
    capacity = opts.kv_capacity_tokens if opts.kv_capacity_tokens is not None else defaults.kv_capacity_tokens
    cache = PrefixCache(capacity, opts.block_size, hasher, keep_kv=defaults.keeps_kv, kv_ops=runner.kv_ops)
    sched = SchedulerConfig(
        max_num_seqs=opts.max_num_seqs or defaults.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens or defaults.max_num_batched_tokens,
        announce_shared_writes=opts.announce_shared_writes,
        announce_local_tiers=opts.announce_local_tiers,
    )
    store: PrefixStore | None = None
    if opts.store:
        from kvmesh.store.cache_engine import KVCacheEngine

        engine = KVCacheEngine.from_config(opts.store)
        if engine.block_size != opts.block_size:
            await engine.aclose()
            raise ValueError(f"store block_size {engine.block_size} != engine block_size {opts.block_size}")
        engine.bind_layout(defaults.store_kv_dtype, defaults.store_kv_layout)
        engine.tiered.expect_chunk_bytes(engine.chunk_size * defaults.store_bytes_per_token)
        store = CacheEngineStore(engine, namespace)
    publisher: EventPublisher = NullEventPublisher()
    events_endpoint = replay_endpoint = None
    if opts.events:
        zmq_pub = ZmqEventPublisher(opts.events, opts.events_replay, topic=opts.events_topic)
        publisher = zmq_pub
        events_endpoint, replay_endpoint = zmq_pub.endpoint, zmq_pub.replay_endpoint
    core = EngineCore(the_runner, cache, sched, store=store, publisher=publisher)
    interval = opts.stream_interval if opts.stream_interval is not None else defaults.stream_interval_s
    config = ServerConfig(
        served_model_name=served,
        model_aliases=tuple({opts.model, info.model_name} - {served}),
        role=opts.role,
        stream_interval=interval,
        events_endpoint=events_endpoint,
        replay_endpoint=replay_endpoint,
        events_topic=opts.events_topic if opts.events else None,
        hash_algo=opts.hash_algo,
        model_path=model_path,
        revision=revision,
        emulate=opts.emulate,
        extra_info=dict(opts.extra_info),
    )
    server = _ClosingServer(core, the_tokenizer, config)
    server.publisher = publisher
    server.store_closer = store
    server.runner_closer = runner
    return server
