"""Gateway overhead, side by side: direct vs ``kvmesh router`` vs ``sglang-router`` (cache_aware).

    .venv/bin/python benchmarks/router_gateway.py [--backends 3] [--duration 8] [--json]

All three targets front the same backend processes in one run. The backends are minimal
OpenAI-style servers (this script with ``--serve-backend``) that answer after ``--backend-delay-ms``
of non-CPU wait, so what is measured is the router, not a model. Prompts are text (shared
system prefixes + distinct questions), so kvmesh tokenizes them with SmolLM2's tokenizer and
hashes blocks, as in production; sglang-router runs its radix tree on the text.

sglang-router is installed by this script into its own venv (``--sglang-venv``, default
``/tmp/kvmesh-sglang-venv``), never into the project's.

Measured per target:
* throughput: closed loop with ``--concurrency`` clients for ``--duration`` seconds;
* latency at moderate load: closed loop with ``--moderate-concurrency`` clients; p50/p99 and the
  difference to direct (``added``);
* router CPU per request during the throughput phase (from /proc), which a shared, loaded
  machine disturbs much less than wall-clock throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvmesh.core.net import free_port

SGLANG_ROUTER_VERSION = "0.3.2"
MODEL = "bench-model"


# ---------------------------------------------------------------------------- backend


def serve_backend(port: int, delay_ms: float, stream_chunks: int = 0) -> None:
    """A minimal OpenAI-style backend: fixed answer after ``delay_ms`` of waiting; a request with
    ``"stream": true`` is answered with ``stream_chunks`` SSE token chunks, a usage chunk and
    ``[DONE]``, written as fast as the connection takes them."""
    from aiohttp import web

    delay = delay_ms / 1000.0
    body = json.dumps(
        {
            "id": "cmpl-bench",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": 100,
                "completion_tokens": 1,
                "total_tokens": 101,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
    ).encode()

    token = (
        b'data: {"id": "cmpl-bench", "object": "text_completion", "model": "%s", "choices": [{"index": 0, "text": " ok", "finish_reason": null}]}\n\n'
        % MODEL.encode()
    )
    usage = b'data: {"id": "cmpl-bench", "object": "text_completion", "model": "%s", "choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": %d, "total_tokens": %d, "prompt_tokens_details": {"cached_tokens": 0}}}\n\ndata: [DONE]\n\n' % (MODEL.encode(), stream_chunks, 100 + stream_chunks)  # fmt: skip

    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if delay:
            await asyncio.sleep(delay)
        if not (stream_chunks and b'"stream": true' in raw):
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(stream_chunks):
            await resp.write(token)
        await resp.write(usage)
        await resp.write_eof()
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}
        )

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            text="vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
        )

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/generate", completions)
    for path in (
        "/health",
        "/health_generate",
        "/get_server_info",
        "/get_model_info",
        "/server_info",
        "/model_info",
    ):
        app.router.add_get(path, ok)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_passthrough(port: int, upstreams: list[str], *, own_client: bool = False) -> None:
    """The least an aiohttp gateway does per request: read the body, post it to the next upstream
    (round robin, one pooled client session), return the answer. No parsing, no routing: the
    floor under any router built on aiohttp, run on uvloop as ``kvmesh router`` is. With
    ``own_client`` the upstream requests go through the router's client
    (``kvmesh.router.upstream_http``) instead of aiohttp's: what aiohttp's server alone costs."""
    import itertools

    import aiohttp
    import uvloop
    from aiohttp import web

    from kvmesh.router.upstream_http import UpstreamClient

    turn = itertools.cycle(upstreams)
    client = UpstreamClient()
    json_type = {"Content-Type": "application/json"}

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        if own_client:
            up = await client.post(next(turn), request.path, body, json_type, timeout_s=30)
            try:
                return web.Response(body=await up.read(), status=up.status, content_type="application/json")
            finally:
                up.release()
        session: aiohttp.ClientSession = request.app["session"]
        async with session.post(next(turn) + request.path, data=body, headers=json_type) as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def open_session(app: web.Application) -> Any:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(open_session)
    app.router.add_post("/v1/completions", forward)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", ok)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, loop=uvloop.new_event_loop())


def serve_asyncio_passthrough(port: int, upstreams: list[str]) -> None:
    """The least a Python gateway does per request: requests parsed by llhttp (``httptools``) in
    an asyncio protocol, each body posted to the next upstream with the router's own client
    (``kvmesh.router.upstream_http``), the answer written back. No aiohttp on either side, no
    parsing of the body, no routing: the floor under any router written in Python on uvloop."""
    import itertools

    import httptools
    import uvloop

    from kvmesh.router.upstream_http import UpstreamClient

    client = UpstreamClient()
    turn = itertools.cycle(upstreams)
    json_type = {"Content-Type": "application/json"}

    class Front(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpRequestParser(self)
            self.url = b""
            self.body: list[bytes] = []

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_url(self, url: bytes) -> None:
            self.url = url

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            body, self.body = b"".join(self.body), []
            asyncio.get_running_loop().create_task(self.answer(self.url.decode(), body))

        async def answer(self, path: str, body: bytes) -> None:
            if path == "/health":
                status, out = 200, b'{"status": "ok"}'
            else:
                resp = await client.post(next(turn), path, body, json_type, timeout_s=30)
                try:
                    status, out = resp.status, await resp.read()
                finally:
                    resp.release()
            self.transport.write(
                b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (status, len(out), out)
            )

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Front, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(serve())


PASSTHROUGHS = {
    "aiohttp pass-through (floor)": "aiohttp",
    "aiohttp server + kvmesh client pass-through": "aiohttp-server",
    "asyncio pass-through (Python floor)": "asyncio",
}
"""``--passthrough`` targets: label -> ``--serve-passthrough-kind``."""


def start_passthroughs(procs: Procs, backend_urls: list[str]) -> dict[str, tuple[str, int]]:
    """Start the pass-through floors before ``backend_urls``: label -> (url, pid)."""
    started: dict[str, tuple[str, int]] = {}
    for label, kind in PASSTHROUGHS.items():
        port = free_port()
        proc = procs.start(
            [sys.executable, __file__, "--serve-passthrough", str(port), "--serve-passthrough-kind", kind,
             "--upstreams", ",".join(backend_urls)]
        )  # fmt: skip
        wait_http(f"http://127.0.0.1:{port}/health", 30)
        started[label] = (f"http://127.0.0.1:{port}", proc.pid)
    return started


# ---------------------------------------------------------------------------- processes


def wait_http(url: str, timeout: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status < 500:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not up after {timeout}s")
        time.sleep(0.2)


def ensure_sglang_router(venv: Path) -> Path:
    """The venv's python with sglang-router installed (created on first use)."""
    python = venv / "bin" / "python"
    if python.exists():
        probe = subprocess.run([python, "-c", "import sglang_router"], capture_output=True)
        if probe.returncode == 0:
            return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [python, "-m", "pip", "install", "-q", f"sglang-router=={SGLANG_ROUTER_VERSION}"], check=True
    )
    return python


def cpu_seconds(pid: int, *, descendants: bool = True) -> float:
    """User + system CPU seconds of a process (all threads) and, unless ``descendants`` is false,
    its live descendants, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split() if descendants else []
    except FileNotFoundError:
        return 0.0
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(cpu_seconds(int(child)) for child in children)


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ---------------------------------------------------------------------------- load


TOKENS_PER_RULE = 8.2
"""SmolLM2 tokens per "Rule i: ...." sentence of the text prompts (measured)."""


def make_prompts(n: int, seed: int = 0, kind: str = "text", prompt_tokens: int = 500) -> list[Any]:
    """Shared system prefixes + distinct questions, as text or as token ids, of about
    ``prompt_tokens`` tokens each."""
    rng = random.Random(seed)
    num_rules = max(1, round((prompt_tokens - 10) / TOKENS_PER_RULE))
    if kind == "tokens":
        systems_ids = [[rng.randrange(1000, 40_000) for _ in range(prompt_tokens - 20)] for _ in range(8)]
        return [rng.choice(systems_ids) + [rng.randrange(1000, 40_000) for _ in range(24)] for _ in range(n)]
    systems = [
        f"You are assistant #{g}. " + " ".join(f"Rule {i}: {rng.choice(['be brief', 'cite sources', 'use SI units', 'no jargon'])}." for i in range(num_rules))
        for g in range(8)
    ]  # fmt: skip
    return [f"{rng.choice(systems)}\nQuestion {i}: what is {rng.randrange(10**6)} squared?" for i in range(n)]


async def closed_loop(
    urls: list[str], prompts: list[str], concurrency: int, duration: float, *, stream: bool = False
) -> dict[str, float]:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + duration
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client(c: int) -> None:
            nonlocal errors
            i = c
            while time.perf_counter() < stop_at:
                url = urls[i % len(urls)]
                body: dict[str, Any] = {"model": MODEL, "prompt": prompts[i % len(prompts)], "max_tokens": 1}
                if stream:
                    body["stream"] = True
                start = time.perf_counter()
                try:
                    async with session.post(f"{url}/v1/completions", json=body) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - start)
                else:
                    errors += 1
                i += concurrency

        begin = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(concurrency)))
        elapsed = time.perf_counter() - begin
    latencies.sort()
    if not latencies:
        return {"rps": 0.0, "p50_ms": float("nan"), "p99_ms": float("nan"), "errors": errors}
    return {
        "rps": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3,
        "errors": errors,
    }


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--serve-backend", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--serve-passthrough", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--upstreams", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--serve-passthrough-kind",
        choices=["aiohttp", "aiohttp-server", "asyncio"],
        default="aiohttp",
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--passthrough",
        action="store_true",
        help="add bare pass-through proxies (no parsing, no routing): on aiohttp; aiohttp's server with the "
        "router's upstream client; asyncio protocols with the router's client (the floor of any Python router)",
    )
    parser.add_argument("--backends", type=int, default=3)
    parser.add_argument("--backend-delay-ms", type=float, default=5.0)
    parser.add_argument(
        "--stream-chunks",
        type=int,
        default=0,
        help="requests ask for a stream and the backends answer with this many SSE token chunks "
        "(0: no streaming; the pass-through floors buffer the answer instead of streaming it)",
    )
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--moderate-concurrency", type=int, default=4)
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternate the targets this many times; medians reported"
    )
    parser.add_argument(
        "--kvmesh-policy", default="precise", help="comma-separated presets: one kvmesh target per preset"
    )
    parser.add_argument(
        "--kvmesh-workers",
        default="1",
        help="comma-separated worker counts: one kvmesh target per count (kvmesh router --workers N)",
    )
    parser.add_argument(
        "--kvmesh-aiohttp-only",
        action="store_true",
        help="also run each kvmesh target with --aiohttp-only (every route on aiohttp, no front)",
    )
    parser.add_argument(
        "--kvmesh-thread-min-chars",
        type=int,
        default=None,
        help="kvmesh: text this long is tokenized on a thread",
    )
    parser.add_argument("--sglang-venv", type=Path, default=Path("/tmp/kvmesh-sglang-venv"))
    parser.add_argument("--skip-sglang", action="store_true")
    parser.add_argument(
        "--prompts",
        choices=["text", "tokens"],
        default="text",
        help="text prompts (kvmesh tokenizes them) or token-id prompts (passed through)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=500, help="about this many tokens per prompt (default 500)"
    )
    parser.add_argument(
        "--warmup-s", type=float, default=1.0, help="unmeasured load per target before each round"
    )
    parser.add_argument("--num-prompts", type=int, default=2000, help="distinct prompts cycled through")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.serve_backend:
        serve_backend(args.serve_backend, args.backend_delay_ms, args.stream_chunks)
        return 0
    if args.serve_passthrough:
        upstreams = args.upstreams.split(",")
        if args.serve_passthrough_kind == "asyncio":
            serve_asyncio_passthrough(args.serve_passthrough, upstreams)
        else:
            serve_passthrough(
                args.serve_passthrough, upstreams, own_client=args.serve_passthrough_kind != "aiohttp"
            )
        return 0

    procs = Procs()
    temp_files: list[Path] = []
    try:
        backend_urls = []
        for _ in range(args.backends):
            port = free_port()
            procs.start(
                [
                    sys.executable,
                    __file__,
                    "--serve-backend",
                    str(port),
                    "--backend-delay-ms",
                    str(args.backend_delay_ms),
                    "--stream-chunks",
                    str(args.stream_chunks),
                ]
            )
            backend_urls.append(f"http://127.0.0.1:{port}")
        for url in backend_urls:
            wait_http(f"{url}/health", 30)

        targets: dict[str, list[str]] = {"direct": backend_urls}
        pids: dict[str, int] = {}
        kv_port = free_port()
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        kv_extra: list[str] = []
        if args.kvmesh_thread_min_chars is not None:
            cfg = Path(tempfile.gettempdir()) / f"kvmesh-bench-router-{kv_port}.yaml"
            cfg.write_text(f"tokenizeThreadMinChars: {args.kvmesh_thread_min_chars}\n")
            temp_files.append(cfg)
            kv_extra = ["--config", str(cfg)]
        variants = [("", [])] + ([(", aiohttp only", ["--aiohttp-only"])] if args.kvmesh_aiohttp_only else [])
        runs = [
            (policy, int(n), suffix, variant_args)
            for policy in args.kvmesh_policy.split(",")
            for n in args.kvmesh_workers.split(",")
            for suffix, variant_args in variants
        ]
        for policy, num_workers, suffix, variant_args in runs:
            kv_port = free_port()
            kv_proc = procs.start(
                [sys.executable, "-m", "kvmesh", "router", "--endpoints", ",".join(backend_urls), "--policy",
                 policy, "--port", str(kv_port), "--model", MODEL, "--tokenizer", "smollm2",
                 "--log-level", "warning", "--workers", str(num_workers), *kv_extra, *variant_args],
                env=env,
            )  # fmt: skip
            wait_http(f"http://127.0.0.1:{kv_port}/health", 120)
            workers = f"{num_workers} worker{'s' if num_workers > 1 else ''}"
            name = f"kvmesh ({policy}, {workers}{suffix})"
            targets[name] = [f"http://127.0.0.1:{kv_port}"]
            pids[name] = kv_proc.pid
        if args.passthrough:
            for label, (url, pid) in start_passthroughs(procs, backend_urls).items():
                targets[label] = [url]
                pids[label] = pid
        if not args.skip_sglang:
            python = ensure_sglang_router(args.sglang_venv)
            sg_port, sg_prom = free_port(), free_port()
            sg_proc = procs.start(
                [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(sg_port),
                 "--worker-urls", *backend_urls, "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
                 "--prometheus-port", str(sg_prom), "--log-level", "warn"],
            )  # fmt: skip
            wait_http(f"http://127.0.0.1:{sg_port}/health", 120)
            targets["sglang-router (cache_aware)"] = [f"http://127.0.0.1:{sg_port}"]
            pids["sglang-router (cache_aware)"] = sg_proc.pid

        prompts = make_prompts(args.num_prompts, kind=args.prompts, prompt_tokens=args.prompt_tokens)
        rounds: dict[str, list[dict[str, float]]] = {t: [] for t in targets}
        for _ in range(args.rounds):
            for name, urls in targets.items():
                # warm connections and caches (the tokenizer learns shared prefixes from the first prompts)
                stream = args.stream_chunks > 0
                asyncio.run(closed_loop(urls, prompts, 4, args.warmup_s, stream=stream))
                cpu_before = cpu_seconds(pids[name]) if name in pids else 0.0
                heavy = asyncio.run(
                    closed_loop(urls, prompts, args.concurrency, args.duration, stream=stream)
                )
                cpu_used = cpu_seconds(pids[name]) - cpu_before if name in pids else 0.0
                served = heavy["rps"] * args.duration
                moderate = asyncio.run(
                    closed_loop(urls, prompts, args.moderate_concurrency, args.duration, stream=stream)
                )
                rounds[name].append(
                    {"rps": heavy["rps"], "errors": heavy["errors"] + moderate["errors"],
                     "cpu_ms_per_req": 1e3 * cpu_used / served if served else float("nan"),
                     "moderate_rps": moderate["rps"], "p50_ms": moderate["p50_ms"], "p99_ms": moderate["p99_ms"]}
                )  # fmt: skip
    finally:
        procs.stop_all()
        for path in temp_files:
            path.unlink(missing_ok=True)

    results: dict[str, dict[str, float]] = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in rounds.items()
    }
    direct = results["direct"]
    for r in results.values():
        r["added_p50_ms"] = r["p50_ms"] - direct["p50_ms"]
        r["added_p99_ms"] = r["p99_ms"] - direct["p99_ms"]
    report: dict[str, Any] = {
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("serve_backend", "serve_passthrough", "serve_passthrough_kind", "upstreams")
        },
        "results": results,
    }
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"gateway overhead, {args.prompts} prompts: {args.backends} backends ({args.backend_delay_ms:g} ms each), "
        f"throughput at {args.concurrency} clients, latency at {args.moderate_concurrency}"
    )
    columns = ("target", "req/s", "router CPU ms/req", "req/s (moderate)", "p50 ms", "p99 ms", "added p50 ms",
               "added p99 ms", "errors")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right" if col != "target" else "left")
    for name, r in results.items():
        table.add_row(
            name, f"{r['rps']:.0f}", f"{r['cpu_ms_per_req']:.2f}" if name in pids else "-", f"{r['moderate_rps']:.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
            f"{r['added_p50_ms']:+.2f}", f"{r['added_p99_ms']:+.2f}", f"{r['errors']:.0f}",
        )  # fmt: skip
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
