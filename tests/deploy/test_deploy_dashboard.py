"""The Grafana dashboard: built from code, and every query reads a metric kvmesh really exports."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web
from deploy_paths import DEPLOY
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.core.tokens import Tokenizer
from kvmesh.core.types import BlockKey
from kvmesh.engine.app import EngineOptions, build_engine
from kvmesh.engine.emulated_runner import EmulatedRunner
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.gateway import Gateway
from kvmesh.store.backends.memory import MemoryBackend
from kvmesh.store.codec import ChunkCodec
from kvmesh.store.keys import StoreKey
from kvmesh.store.tiered import Tier, TieredStore

DASHBOARD = DEPLOY / "grafana" / "kvmesh-dashboard.json"
METRIC = re.compile(r"\b(?:vllm:|kvmesh[_:])[A-Za-z0-9_:]*")
BY = re.compile(r"\bby \(([^)]*)\)")
SCRAPE_LABELS = {"pod", "le"}
"""Labels Prometheus adds (``pod`` from the PodMonitor) or histograms carry."""


def _queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def _exposition(text: str) -> dict[str, set[str]]:
    """Every sample name in a scrape, with the label names seen on it."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        names.setdefault(family.name, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


async def _scrape_everything() -> dict[str, set[str]]:
    """A router in front of an emulated engine after one request, and a two-tier store after a hit."""
    tokenizer = Tokenizer.load("tiny-random-llama")
    opts = EngineOptions(model="tiny-random-llama", emulate="tiny-h100", events="tcp://127.0.0.1:0")
    runner = EmulatedRunner(
        "tiny-h100",
        model_name=opts.served_model_name,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=tokenizer.eos_token_ids,
        max_model_len=opts.max_model_len,
    )
    engine = await build_engine(opts, runner=runner, tokenizer=tokenizer)
    await engine.start("127.0.0.1", 0)
    gateway = Gateway(router_config_from_dict({"endpoints": [{"url": engine.url}], "policy": "precise"}))
    await gateway.start()
    names: dict[str, set[str]] = {}
    try:
        async with aiohttp.ClientSession() as http:
            app = web.AppRunner(gateway.app)
            await app.setup()
            site = web.TCPSite(app, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            body = {"prompt": list(range(1, 70)), "max_tokens": 4}
            for _ in range(2):
                async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", data=b"{") as r:
                assert r.status == 400
            # The router indexes the engine's events asynchronously: scrape once they are in.
            deadline = asyncio.get_running_loop().time() + 10.0
            while True:
                scraped: dict[str, set[str]] = {}
                for url in (f"http://127.0.0.1:{port}/metrics", f"{engine.url}/metrics"):
                    async with http.get(url) as r:
                        for name, labels in _exposition(await r.text()).items():
                            scraped.setdefault(name, set()).update(labels)
                indexed = "endpoint" in scraped.get("kvmesh_router_pod_indexed_blocks", set())
                if indexed or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.1)
            for name, labels in scraped.items():
                names.setdefault(name, set()).update(labels)
            await app.cleanup()
    finally:
        await gateway.aclose()
        await engine.stop()

    codec = ChunkCodec()
    store = TieredStore([Tier("cpu", MemoryBackend(1 << 20)), Tier("shared", MemoryBackend(1 << 20))], codec)
    keys = [StoreKey("00000000000000aa", BlockKey(i.to_bytes(16, "big"))) for i in range(3)]
    kv = np.random.default_rng(0).standard_normal((1, 2, 2, 4, 8)).astype(np.float32)
    await store.put([(k, codec.encode(k, kv)) for k in keys[:2]])
    await store.get_prefix(keys)
    await store.aclose()
    for name, labels in _exposition(store.metrics.render().decode()).items():
        names.setdefault(name, set()).update(labels)
    return names


def test_the_json_is_what_the_code_builds(deploy_python: Path) -> None:
    run = subprocess.run(
        [str(deploy_python), str(DEPLOY / "grafana" / "dashboard.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr


async def test_every_query_reads_exported_metrics() -> None:
    exported = await _scrape_everything()
    queries = _queries()
    assert len(queries) >= 30
    for expr in queries:
        metrics = METRIC.findall(expr)
        assert metrics, f"no kvmesh or vLLM metric in {expr!r}"
        for name in metrics:
            assert name in exported, f"{name} (in {expr!r}) is not exported"
        labels = set().union(*(exported[m] for m in metrics))
        for group in BY.findall(expr):
            for label in {x.strip() for x in group.split(",")} - SCRAPE_LABELS:
                assert label in labels, f"label {label!r} of {expr!r} is not on {metrics}"


def test_the_matcher_sees_every_name() -> None:
    assert METRIC.findall(
        "sum by (tier) (rate(kvmesh:cached_tokens_total[5m])) / sum(rate(vllm:prompt_tokens_total[5m]))"
    ) == ["kvmesh:cached_tokens_total", "vllm:prompt_tokens_total"]
    assert BY.findall("histogram_quantile(0.9, sum by (le, pod) (rate(x_bucket[5m])))") == ["le, pod"]
