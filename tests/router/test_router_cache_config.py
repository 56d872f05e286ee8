"""The router reads a vLLM endpoint's KV capacity from ``vllm:cache_config_info``: the parser on
what vLLM 0.32 (CPU) prints, malformed and fuzzed labels, and the endpoint pool and gateway scraping
an HTTP endpoint that serves it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from router_fakes import LoopbackApp

from kvmesh.core.types import PodId
from kvmesh.router import cache_config
from kvmesh.router.cache_config import CacheConfigWatch, cache_config_samples, capacity_of_samples
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.endpoints import EndpointConfig, EndpointPool
from kvmesh.router.gateway import Gateway

VLLM_CPU_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 0.0
# HELP vllm:request_prefill_kv_computed_tokens_created Histogram of new KV tokens computed during prefill (excluding cached tokens).
# TYPE vllm:request_prefill_kv_computed_tokens_created gauge
vllm:request_prefill_kv_computed_tokens_created{engine="0",model_name="smollm2"} 1.7957530235683343e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",cache_hit_alignment_tokens="None",effective_attention_block_size="128",enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="5.6875",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="23296",kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",mamba_cache_dtype="auto",mamba_cache_mode="none",mamba_page_size_padded="None",mamba_ssm_cache_dtype="float32",num_cpu_blocks="None",num_gpu_blocks="182",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="False"} 1.0
# HELP http_requests_total Total number of requests by method, status and handler.
"""
"""Part of ``GET /metrics`` of vLLM 0.32 (CPU) serving SmolLM2-135M with 1 GiB of KV
(``VLLM_CPU_KVCACHE_SPACE=1``); its log said "CPU KV cache size: 23,296 tokens"."""

VLLM_CPU_CACHE_LINE = next(
    line for line in VLLM_CPU_METRICS.splitlines() if line.startswith("vllm:cache_config_info{")
)
VLLM_CPU_CAPACITY = 182 * 128
POD = PodId("http://127.0.0.1:1")


def with_labels(line: str, **changes: str | None) -> str:
    """``line`` with labels replaced (``None`` drops one)."""
    head, _, rest = line.partition("{")
    body, _, value = rest.rpartition("}")
    labels = dict(part.split("=", 1) for part in body.split('",') if part)
    labels = {k: v.strip('"') for k, v in labels.items()}
    for key, new in changes.items():
        if new is None:
            labels.pop(key, None)
        else:
            labels[key] = new
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{head}{{{inner}}}{value}"


def test_real_vllm_cpu_metrics_give_blocks_times_block_size():
    samples = cache_config_samples(VLLM_CPU_METRICS)
    assert samples == VLLM_CPU_CACHE_LINE
    assert capacity_of_samples(samples) == VLLM_CPU_CAPACITY == 23_296
    assert cache_config_samples(VLLM_CPU_CACHE_LINE) == VLLM_CPU_CACHE_LINE  # first and last line


def test_data_parallel_samples_carry_the_summed_blocks_once():
    # vLLM's front end sums num_gpu_blocks over its engines; each engine's sample repeats the sum
    two = [with_labels(VLLM_CPU_CACHE_LINE, engine=str(i), num_gpu_blocks="364") for i in range(2)]
    text = "# TYPE vllm:cache_config_info gauge\n" + "\n".join(two) + "\nother_metric 1\n"
    assert cache_config_samples(text) == "\n".join(two)
    assert capacity_of_samples(cache_config_samples(text)) == 364 * 128


def test_the_override_is_already_in_num_gpu_blocks():
    line = with_labels(VLLM_CPU_CACHE_LINE, num_gpu_blocks="16", num_gpu_blocks_override="16")
    assert capacity_of_samples(line) == 16 * 128


def test_absent_gauge_is_unknown_capacity():
    text = VLLM_CPU_METRICS.replace(VLLM_CPU_CACHE_LINE + "\n", "")
    assert cache_config_samples(text) == ""
    watch = CacheConfigWatch(POD)
    assert watch.read(text) == 0
    assert watch.num_unreadable == 0


@pytest.mark.parametrize(
    "changes",
    [
        {"num_gpu_blocks": "None"},
        {"num_gpu_blocks": None},
        {"block_size": None},
        {"block_size": "0"},
        {"num_gpu_blocks": "-182"},
        {"num_gpu_blocks": "1.8e2"},
        {"num_gpu_blocks": " 182"},
        {"num_gpu_blocks": "9" * 5000},  # int() refuses over 4,300 digits by raising
        {"block_size": "\u0661\u0662\u0668"},  # digits int() reads, but not ASCII
    ],
)
def test_malformed_labels_leave_capacity_unknown_and_are_logged_once(changes, caplog):
    text = VLLM_CPU_METRICS.replace(VLLM_CPU_CACHE_LINE, with_labels(VLLM_CPU_CACHE_LINE, **changes))
    watch = CacheConfigWatch(POD)
    with caplog.at_level(logging.WARNING, logger="kvmesh.router.cache_config"):
        assert [watch.read(text) for _ in range(3)] == [0, 0, 0]
    assert watch.num_unreadable == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"endpoint {POD}: vllm:cache_config_info carries no positive num_gpu_blocks and block_size; "
        "KV capacity unknown"
    ]


@pytest.mark.parametrize(
    "line",
    [
        "vllm:cache_config_info{",
        'vllm:cache_config_info{block_size="128",num_gpu_blocks="182" 1.0',
        'vllm:cache_config_info{block_size="128,num_gpu_blocks="182"} 1.0',
        "vllm:cache_config_info{} 1.0",
    ],
)
def test_broken_sample_lines_are_unknown_capacity(line):
    assert CacheConfigWatch(POD).read(f"a 1\n{line}\nb 2\n") == 0


def test_the_gauge_is_parsed_again_only_when_its_lines_change(monkeypatch):
    parsed: list[str] = []
    real = cache_config.capacity_of_samples

    def counting(samples: str) -> int:
        parsed.append(samples)
        return real(samples)

    monkeypatch.setattr(cache_config, "capacity_of_samples", counting)
    watch = CacheConfigWatch(POD)
    busier = VLLM_CPU_METRICS.replace('num_requests_running{engine="0",model_name="smollm2"} 0.0', "x 5")
    assert [watch.read(VLLM_CPU_METRICS), watch.read(busier), watch.read(VLLM_CPU_METRICS)] == [
        VLLM_CPU_CAPACITY
    ] * 3
    assert len(parsed) == 1
    # restarted with a bigger KV cache
    restarted = VLLM_CPU_METRICS.replace('num_gpu_blocks="182"', 'num_gpu_blocks="364"')
    assert watch.read(restarted) == 364 * 128
    assert len(parsed) == 2
    # restarted as something that does not export the gauge
    assert watch.read(busier.replace(VLLM_CPU_CACHE_LINE, "")) == 0
    assert len(parsed) == 2


label_values = st.text(alphabet=st.characters(codec="utf-8"), max_size=24) | st.integers(-5, 10**20).map(str)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    labels=st.dictionaries(
        st.sampled_from(["block_size", "num_gpu_blocks", "engine", "x", "num_gpu_blocks_override"])
        | st.text(max_size=8),
        label_values,
        max_size=6,
    ),
    value=st.sampled_from(["1.0", "", " nan", "}", "1 2 3"]),
    before=st.text(max_size=40),
    after=st.text(max_size=40),
)
def test_fuzzed_labels_never_raise(labels, value, before, after):
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    text = f"{before}\nvllm:cache_config_info{{{inner}}}{value}\n{after}"
    capacity = CacheConfigWatch(POD).read(text)
    assert capacity >= 0
    plain = all(k.isascii() and k.isidentifier() for k in labels) and not any(
        c in v for v in labels.values() for c in '"\\\n'
    )
    if plain:  # the line is well-formed Prometheus text: the capacity is exactly the labels' product
        blocks, size = (labels.get(name, "") for name in ("num_gpu_blocks", "block_size"))
        readable = all(v.isascii() and v.isdigit() and len(v) <= 15 for v in (blocks, size))
        assert capacity == (int(blocks) * int(size) if readable else 0)


@given(blocks=st.integers(1, 10**9), size=st.sampled_from([1, 16, 64, 128, 256]), engine=st.integers(0, 7))
def test_well_formed_labels_give_their_product(blocks, size, engine):
    line = with_labels(
        VLLM_CPU_CACHE_LINE, num_gpu_blocks=str(blocks), block_size=str(size), engine=str(engine)
    )
    assert CacheConfigWatch(POD).read(VLLM_CPU_METRICS.replace(VLLM_CPU_CACHE_LINE, line)) == blocks * size


class VllmMetricsEndpoint(LoopbackApp):
    """An HTTP endpoint serving vLLM's ``/metrics``; ``/kvmesh/info`` answers 404 as vLLM does
    unless ``info`` is set (a kvmesh engine)."""

    def __init__(self, metrics: str, info: dict[str, Any] | None = None) -> None:
        self.metrics = metrics
        self.info = info

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/kvmesh/info", self._info)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics, content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _info(self, request: web.Request) -> web.Response:
        return web.Response(status=404) if self.info is None else web.json_response(self.info)


async def test_pool_sets_vllm_capacity_and_keeps_a_kvmesh_engines_own():
    vllm = await VllmMetricsEndpoint(VLLM_CPU_METRICS).start()
    engine = await VllmMetricsEndpoint(VLLM_CPU_METRICS, info={"kv_capacity_tokens": 5000}).start()
    try:
        async with aiohttp.ClientSession() as session:
            pool = EndpointPool(session, metrics_interval=0)
            first = await pool.add(EndpointConfig(url=vllm.url))
            second = await pool.add(EndpointConfig(url=engine.url))
            assert first.state.kv_capacity_tokens == 0  # until the first scrape
            for endpoint in (first, second):
                await pool._scrape(endpoint)
            assert [s.kv_capacity_tokens for s in pool.states()] == [VLLM_CPU_CAPACITY, 5000]
            # vLLM restarted with another KV size; then as a server without the gauge
            vllm.metrics = VLLM_CPU_METRICS.replace('num_gpu_blocks="182"', 'num_gpu_blocks="91"')
            await pool._scrape(first)
            assert first.state.kv_capacity_tokens == 91 * 128
            vllm.metrics = VLLM_CPU_METRICS.replace(
                VLLM_CPU_CACHE_LINE, with_labels(VLLM_CPU_CACHE_LINE, block_size=None)
            )
            await pool._scrape(first)
            assert first.state.kv_capacity_tokens == 0
            assert first.cache_config is not None and first.cache_config.num_unreadable == 1
    finally:
        await vllm.stop()
        await engine.stop()


async def test_gateway_scheduler_sees_a_vllm_endpoints_capacity():
    vllm = await VllmMetricsEndpoint(VLLM_CPU_METRICS).start()
    config = router_config_from_dict(
        {
            "model": "test-model",
            "policy": "load",
            "endpoints": [{"url": vllm.url}],
            "health": {"metricsIntervalS": 0.05},
        }
    )
    gateway = Gateway(config)
    await gateway.start()
    try:
        assert gateway.pool is not None
        states = gateway.pool.states()
        for _ in range(100):
            if states[0].kv_capacity_tokens:
                break
            await asyncio.sleep(0.05)
        assert [(s.pod, s.kv_capacity_tokens) for s in states] == [(vllm.url, VLLM_CPU_CAPACITY)]
        exported = generate_latest(gateway.metrics.registry).decode()
        assert f'kvmesh_router_endpoint_kv_capacity_tokens{{endpoint="{vllm.url}"}} 23296.0' in exported
    finally:
        await gateway.aclose()
        await vllm.stop()
