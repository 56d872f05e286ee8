"""Router test helpers: an in-process OpenAI-style engine.

``FakeEngine`` is a small but real server: it keeps a prefix cache keyed with kvmesh's own
BlockHasher (per tenant namespace), publishes BlockStored/BlockRemoved through a real
ZmqEventPublisher, reports ``usage.prompt_tokens_details.cached_tokens``, streams SSE, serves
``/kvmesh/info``, ``/health`` and vLLM-named ``/metrics``, and records every body it received.
Token-id prompts only (text needs a tokenizer, which the gateway tests inject separately).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from kvmesh.core.event_transport import ZmqEventPublisher
from kvmesh.core.events import BlockRemoved, BlockStored
from kvmesh.core.hashing import BlockHasher, Namespace
from kvmesh.core.net import free_port
from kvmesh.core.types import BlockKey

MODEL = "test-model"
BLOCK = 16


def engine_hash(key: BlockKey) -> int:
    """The engine's wire hash of a block (first 8 bytes big-endian, as kvmesh engines publish)."""
    return int.from_bytes(key[:8], "big")


class LoopbackApp:
    """An aiohttp app on 127.0.0.1 at a free port: subclasses add their routes in :meth:`routes`."""

    runner: web.AppRunner | None = None
    url: str = ""

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def start(self) -> Any:
        app = web.Application()
        self.routes(app)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@dataclass
class FakeEngine:
    """An OpenAI-compatible test engine with a real prefix cache and real KV events."""

    name: str
    capacity_blocks: int = 10_000
    stream_delay: float = 0.0
    role: str = "both"
    publisher: ZmqEventPublisher | None = None
    runner: web.AppRunner | None = None
    url: str = ""
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    cache: OrderedDict[BlockKey, None] = field(default_factory=OrderedDict)
    gate: asyncio.Event | None = None
    """When set, streams pause after their first chunk until the event is set."""
    prefill_gate: asyncio.Event | None = None
    """When set, streams send nothing (the prefill runs) until the event is set."""
    waiting: int = 0
    running: int = 0
    healthy: bool = True
    vllm_like: bool = False
    """Answer 404 on /kvmesh/info, as an unmodified vLLM pod does."""
    num_health_checks: int = 0

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> FakeEngine:
        self.publisher = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kvmesh/info", self._info)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        port = port or free_port()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        self.url = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def cached_tokens(self, tokens: list[int], tenant: str = "") -> int:
        keys = BlockHasher(Namespace(MODEL, tenant=tenant), BLOCK).hash_blocks(tokens)
        n = 0
        for key in keys:
            if key not in self.cache:
                break
            n += 1
        return n * BLOCK

    def _serve_prompt(self, tokens: list[int], tenant: str) -> int:
        hasher = BlockHasher(Namespace(MODEL, tenant=tenant), BLOCK)
        keys = hasher.hash_blocks(tokens)
        hit = 0
        for key in keys:
            if key not in self.cache:
                break
            self.cache.move_to_end(key)
            hit += 1
        new = keys[hit:]
        events: list[Any] = []
        if new:
            parent = engine_hash(keys[hit - 1]) if hit else None
            events.append(
                BlockStored(
                    [engine_hash(k) for k in new],
                    parent,
                    tokens[hit * BLOCK : len(keys) * BLOCK],
                    BLOCK,
                    extra_keys=[tenant] if tenant and hit == 0 else None,
                )
            )
            for key in new:
                self.cache[key] = None
        evicted = []
        while len(self.cache) > self.capacity_blocks:
            key, _ = self.cache.popitem(last=False)
            evicted.append(engine_hash(key))
        if evicted:
            events.append(BlockRemoved(evicted))
        if events and self.publisher is not None:
            self.publisher.publish(events)
        return hit * BLOCK

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.headers.append(dict(request.headers))
        prompt = body.get("prompt")
        tokens = prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else []
        tenant = request.headers.get("x-tenant-id") or body.get("cache_salt") or ""
        cached = self._serve_prompt(tokens, tenant)
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": 3,
            "total_tokens": len(tokens) + 3,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "c1",
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": self.name}],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse()
        resp.headers["Content-Type"] = "text/event-stream"
        await resp.prepare(request)
        if self.prefill_gate is not None:
            await self.prefill_gate.wait()
        for i in range(3):
            chunk = {"id": "c1", "choices": [{"index": 0, "text": f"{self.name}-{i}"}]}
            await resp.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
            if i == 0 and self.gate is not None:
                await self.gate.wait()
            if self.stream_delay:
                await asyncio.sleep(self.stream_delay)
        await resp.write(
            b"data: " + msgspec.json.encode({"id": "c1", "choices": [], "usage": usage}) + b"\n\n"
        )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _health(self, request: web.Request) -> web.Response:
        self.num_health_checks += 1
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        usage = len(self.cache) / self.capacity_blocks
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {self.waiting}\n'
            f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.running}\n'
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} {usage}\n'
        )
        return web.Response(text=text)

    async def _info(self, request: web.Request) -> web.Response:
        assert self.publisher is not None
        if self.vllm_like:
            raise web.HTTPNotFound()
        return web.json_response(
            {
                "model": MODEL,
                "block_size": BLOCK,
                "hash_algo": "sha256",
                "events_endpoint": self.publisher.endpoint,
                "replay_endpoint": self.publisher.replay_endpoint,
                "role": self.role,
                "kv_bytes_per_token": 1024,
                "kv_capacity_tokens": 65536,
                "max_model_len": 8192,
            }
        )


@dataclass
class EngineProcess:
    """A ``kvmesh engine --emulate`` child process and its ready line."""

    proc: subprocess.Popen[bytes]
    info: dict[str, Any]

    @property
    def url(self) -> str:
        return str(self.info["url"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_engine_processes(n: int, *extra: str, timeout: float = 240.0) -> list[EngineProcess]:
    """Start ``n`` emulated engines in parallel and wait for each one's JSON ready line."""
    import json
    import os
    import selectors
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable, "-m", "kvmesh", "engine", "--model", "smollm2", "--emulate", "tiny-h100",
                "--port", "0", "--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0", *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        for _ in range(n)
    ]  # fmt: skip
    ready: dict[int, EngineProcess] = {}
    sel = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        assert p.stdout is not None
        sel.register(p.stdout, selectors.EVENT_READ, i)
    deadline = time.monotonic() + timeout
    try:
        while len(ready) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"only {len(ready)} of {n} engines became ready")
            for key, _ in sel.select(remaining):
                i = key.data
                line = procs[i].stdout.readline()  # type: ignore[union-attr]
                if not line:
                    raise RuntimeError(f"engine {i} exited with {procs[i].wait()}")
                ready[i] = EngineProcess(procs[i], json.loads(line))
                sel.unregister(key.fileobj)
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise
    finally:
        sel.close()
    return [ready[i] for i in range(n)]
