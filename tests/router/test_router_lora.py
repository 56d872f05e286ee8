"""LoRA placement: adapter state from vLLM's metrics and model list, the affinity filter and
scorer, and the pool and gateway reading real HTTP endpoints."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web
from router_fakes import LoopbackApp

from kvmesh.core.hashing import Namespace
from kvmesh.errors import ConfigError
from kvmesh.router.endpoints import EndpointConfig, EndpointPool
from kvmesh.router.lora_state import (
    LoraState,
    adapters_of_models,
    merged_models,
    parse_lora_info,
    requested_adapter,
)
from kvmesh.router.plugins.base import PluginContext
from kvmesh.router.plugins.lora import AdapterPlacer, LoraAffinityFilter, LoraAffinityScorer, Saturation
from kvmesh.router.plugins.registry import build_plugin
from kvmesh.router.scheduler import Scheduler, load_scheduler_config
from kvmesh.router.types import EndpointState, RoutingRequest

VLLM_METRICS = """\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.70e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="poem"} 1.72e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""} 1.71e+09
vllm:num_requests_waiting{model_name="base"} 3
"""


def models_doc(base: str, *adapters: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": base, "object": "model", "parent": None}]
        + [{"id": a, "object": "model", "parent": base} for a in adapters],
    }


def test_lora_info_takes_the_newest_sample():
    state = parse_lora_info(VLLM_METRICS)
    assert state == LoraState(max_lora=2, running=frozenset({"sql", "chat"}), waiting=frozenset({"poem"}))
    assert state.active == {"sql", "chat", "poem"}
    assert not state.has_free_slot()


def test_lora_info_absent_or_malformed():
    assert parse_lora_info('vllm:num_requests_waiting{model_name="m"} 1\n') is None
    # declared before the engine's first step, with no sample yet: LoRA is on, nothing runs
    declared = "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n"
    assert parse_lora_info(declared) == LoraState()
    assert parse_lora_info('vllm:lora_requests_info{max_lora="x"} nan\n') is None
    state = parse_lora_info('vllm:lora_requests_info{max_lora="x",running_lora_adapters="a"} 5\n')
    assert state is not None and state.max_lora == 0 and state.running == {"a"} and state.has_free_slot()


def test_adapters_of_models_lists_entries_with_a_parent():
    assert adapters_of_models(models_doc("base", "sql", "poem")) == {"sql", "poem"}
    assert adapters_of_models({"data": "nope"}) == frozenset()
    assert adapters_of_models([1, 2]) == frozenset()


def test_merged_models_lists_each_id_once():
    a = models_doc("base", "sql")["data"]
    b = models_doc("base", "poem")["data"]
    assert [m["id"] for m in merged_models([a, b])] == ["base", "sql", "poem"]


def lora_endpoint(pod: str, *, servable=(), running=(), waiting=0, max_lora=2, kv=0.0) -> EndpointState:
    lora = LoraState(max_lora=max_lora, running=frozenset(running), servable=frozenset(servable))
    return EndpointState(pod=pod, waiting=waiting, kv_cache_usage=kv, lora=lora)


def request_for(adapter: str) -> RoutingRequest:
    return RoutingRequest("r", [1, 2, 3], Namespace("base", lora=adapter))


def test_requested_adapter_needs_an_endpoint_that_serves_it():
    endpoints = [lora_endpoint("a", servable={"sql"}), EndpointState(pod="b")]
    assert requested_adapter("sql", "base", endpoints) == "sql"
    assert requested_adapter("base", "base", endpoints) == ""
    assert requested_adapter("other-model", "base", endpoints) == ""
    assert requested_adapter(None, "base", endpoints) == ""


def new_filter() -> LoraAffinityFilter:
    return LoraAffinityFilter(AdapterPlacer(Saturation(max_waiting=4, kv_cache_threshold=0.9)))


FILTER = new_filter()


def pods(endpoints: list[EndpointState]) -> list[str]:
    return [e.pod for e in endpoints]


def test_filter_keeps_holders_that_are_not_saturated():
    endpoints = [
        lora_endpoint("holder", servable={"sql"}, running={"sql"}),
        lora_endpoint("idle", servable={"sql"}),
        lora_endpoint("other", servable={"poem"}),
    ]
    assert pods(FILTER.filter(request_for("sql"), endpoints)) == ["holder"]
    # the adapter is active nowhere: every endpoint that serves it with a free slot
    assert pods(FILTER.filter(request_for("poem"), endpoints)) == ["other"]


def test_filter_spreads_an_adapter_when_its_holders_saturate():
    endpoints = [
        lora_endpoint("holder", servable={"sql"}, running={"sql"}, waiting=5),
        lora_endpoint("free", servable={"sql"}),
        lora_endpoint("full", servable={"sql"}, running={"a", "b"}),
        lora_endpoint("busy", servable={"sql"}, kv=0.95),
    ]
    assert pods(FILTER.filter(request_for("sql"), endpoints)) == ["free"]


def test_filter_prefers_a_saturated_holder_to_a_swap():
    endpoints = [
        lora_endpoint("holder", servable={"sql"}, running={"sql"}, kv=0.95),
        lora_endpoint("full", servable={"sql"}, running={"a", "b"}),
    ]
    assert pods(FILTER.filter(request_for("sql"), endpoints)) == ["holder"]
    # nobody holds it and every slot is taken: any endpoint that serves it, swapping one out
    assert pods(FILTER.filter(request_for("sql"), endpoints[1:])) == ["full"]


def test_an_adapter_sent_before_the_next_scrape_counts_as_active():
    flt = new_filter()
    endpoints = [
        lora_endpoint("a", servable={"sql", "poem"}, max_lora=1),
        lora_endpoint("b", servable={"sql"}),
    ]
    assert pods(flt.filter(request_for("sql"), endpoints)) == ["a", "b"]
    flt.observe(request_for("sql"), "b")
    # a burst of the same adapter follows the first request, before any scrape shows it
    assert pods(flt.filter(request_for("sql"), endpoints)) == ["b"]
    flt.observe(request_for("poem"), "a")
    # "a" has one slot, now taken by poem: sql would have to swap there
    assert pods(flt.filter(request_for("sql"), endpoints)) == ["b"]
    # the next scrape (a new state object) says what really runs; the notes taken before it lapse
    endpoints[1].lora = LoraState(max_lora=2, servable=frozenset({"sql"}))
    endpoints[0].lora = LoraState(max_lora=1, servable=frozenset({"sql", "poem"}))
    assert pods(flt.filter(request_for("sql"), endpoints)) == ["a", "b"]


def test_the_scheduler_tells_the_filter_where_it_sent_an_adapter():
    scheduler = Scheduler.from_config(load_scheduler_config("load"))
    endpoints = [lora_endpoint("a", servable={"sql"}), lora_endpoint("b", servable={"sql"})]
    first = scheduler.pick(request_for("sql"), endpoints)
    assert first is not None and sorted(first.ranked) == ["a", "b"]
    for _ in range(3):
        again = scheduler.pick(request_for("sql"), endpoints)
        assert again is not None and again.ranked == [first.endpoint]


def test_filter_passes_base_requests_and_unknown_adapters():
    endpoints = [lora_endpoint("a", servable={"sql"}), EndpointState(pod="b")]
    assert pods(FILTER.filter(request_for(""), endpoints)) == ["a", "b"]
    assert pods(FILTER.filter(request_for("nobody-has-it"), endpoints)) == ["a", "b"]


def test_scorer_ranks_loaded_then_free_slot_then_saturated_then_swap():
    scorer = LoraAffinityScorer(AdapterPlacer(Saturation(max_waiting=4, kv_cache_threshold=0.9)))
    endpoints = [
        lora_endpoint("loaded", servable={"sql"}, running={"sql"}),
        lora_endpoint("free", servable={"sql"}),
        lora_endpoint("saturated", servable={"sql"}, running={"sql"}, waiting=9),
        lora_endpoint("swap", servable={"sql"}, running={"a", "b"}),
        lora_endpoint("foreign", servable={"poem"}),
        EndpointState(pod="plain"),
    ]
    assert scorer.score(request_for("sql"), endpoints) == [1.0, 0.6, 0.4, 0.2, 0.0, 0.0]
    assert scorer.score(request_for(""), endpoints) == [1.0] * 6


def test_plugins_build_from_yaml_parameters():
    ctx = PluginContext()
    scorer = build_plugin("lora-affinity-scorer", "s", {"maxWaiting": 1, "freeSlot": 0.9}, ctx)
    assert isinstance(scorer, LoraAffinityScorer)
    assert scorer.placer.saturation.max_waiting == 1 and scorer.free_slot == 0.9
    flt = build_plugin("lora-affinity-filter", "f", {"kvCacheThreshold": 0.5}, ctx)
    assert isinstance(flt, LoraAffinityFilter) and flt.placer.saturation.kv_cache_threshold == 0.5
    with pytest.raises(ConfigError, match="swap must be <= 1"):
        build_plugin("lora-affinity-scorer", "s", {"swap": 2}, ctx)
    with pytest.raises(ConfigError, match="unknown parameters"):
        build_plugin("lora-affinity-filter", "f", {"maxWaitin": 1}, ctx)


def test_default_preset_sends_an_adapter_request_to_its_holder():
    scheduler = Scheduler.from_config(load_scheduler_config("precise"))
    endpoints = [
        lora_endpoint("a", servable={"poem"}),
        lora_endpoint("b", servable={"sql", "poem"}, waiting=2),
        lora_endpoint("c", servable={"poem"}),
    ]
    decision = scheduler.pick(request_for("sql"), endpoints)
    assert decision is not None and decision.ranked == ["b"]
    base = scheduler.pick(request_for(""), endpoints)
    assert base is not None and sorted(base.ranked) == ["a", "b", "c"]


class LoraEngine(LoopbackApp):
    """A vLLM-shaped HTTP endpoint: LoRA metrics and a model list with adapters."""

    def __init__(self, adapters: tuple[str, ...], running: str) -> None:
        self.adapters = adapters
        self.running = running
        self.model_reads = 0
        self.lora_on = True

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)

    async def _metrics(self, request: web.Request) -> web.Response:
        lora = (
            f'vllm:lora_requests_info{{max_lora="1",running_lora_adapters="{self.running}",'
            f'waiting_lora_adapters=""}} 1.7e9\n'
        )
        load = 'vllm:num_requests_running{model_name="base"} 1\n'
        return web.Response(text=lora + load if self.lora_on else load)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        self.model_reads += 1
        return web.json_response(models_doc("base", *self.adapters))


async def test_pool_reads_adapters_from_metrics_and_model_list():
    engines = [await LoraEngine(("sql",), "sql").start(), await LoraEngine(("poem",), "").start()]
    try:
        async with aiohttp.ClientSession() as session:
            pool = EndpointPool(session, metrics_interval=0)
            for engine in engines:
                await pool.add(EndpointConfig(url=engine.url))
            for endpoint in pool.endpoints:
                await pool._scrape(endpoint)
                await pool._scrape(endpoint)
            first, second = (pool.get(e.url) for e in engines)
            assert first is not None and second is not None
            assert first.state.lora == LoraState(1, frozenset({"sql"}), frozenset(), frozenset({"sql"}))
            assert second.state.lora == LoraState(1, frozenset(), frozenset(), frozenset({"poem"}))
            assert first.state.running == 1
            # the model list is read once, then again only when an unlisted adapter runs
            assert [e.model_reads for e in engines] == [1, 1]
            engines[1].running = "poem,new"
            engines[1].adapters = ("poem", "new")
            await pool._scrape(second)
            assert engines[1].model_reads == 2
            assert second.state.lora is not None and second.state.lora.servable == {"poem", "new"}
            assert [m["id"] for m in merged_models(e.models for e in pool.endpoints)] == [
                "base",
                "sql",
                "poem",
                "new",
            ]
            # restarted without LoRA: its adapters are forgotten
            engines[0].lora_on = False
            await pool._scrape(first)
            assert first.state.lora is None and first.models == []
    finally:
        for engine in engines:
            await engine.stop()
