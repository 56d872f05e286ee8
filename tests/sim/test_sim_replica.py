"""One replica against the engine's cost model: exact step times, cache hits, KV pressure."""

import pytest
from sim_helpers import ListWorkload, spec, tokens

from kvmesh.engine.cost_model import CostModel, get_preset
from kvmesh.sim.fleet import FleetConfig, simulate

PRESET = "tiny-h100"  # SmolLM2 shapes on an H100: 65,536 KV tokens, 2048-token step budget


def one(**kw) -> FleetConfig:
    return FleetConfig(num_replicas=1, model_preset=PRESET, policy="round-robin", **kw)


def test_lone_prompt_ttft_is_the_cost_models_chunked_prefill():
    cost = CostModel(get_preset(PRESET))
    wl = ListWorkload([spec(0, 0.0, tokens(1, 1000), 1), spec(1, 10.0, tokens(2, 3000), 1)])
    run = simulate(one(), wl)
    a, b = run.requests
    assert a.first_token - a.arrival == pytest.approx(cost.prefill_time(0, 1000), rel=1e-12)
    assert b.first_token - b.arrival == pytest.approx(cost.chunked_prefill_time(0, 3000, 2048), rel=1e-12)
    assert a.finish == a.first_token  # one output token: done at the first
    assert (a.hit_gpu, b.hit_gpu) == (0, 0)


def test_decode_steps_follow_the_cost_model():
    cost = CostModel(get_preset(PRESET))
    run = simulate(one(), ListWorkload([spec(0, 0.0, tokens(1, 1000), 9)]))
    (r,) = run.requests
    expected = sum(cost.decode_step_time([1000 + g + 1]) for g in range(1, 9))
    assert r.finish - r.first_token == pytest.approx(expected, rel=1e-3)
    assert run.replicas[0].stats.decode_tokens == 8


def test_repeated_prompt_hits_the_device_cache_and_computes_only_the_tail():
    cost = CostModel(get_preset(PRESET))
    toks = tokens(3, 1000)
    run = simulate(one(), ListWorkload([spec(0, 0.0, toks, 1), spec(1, 5.0, toks, 1)]))
    first, second = run.requests
    assert first.hit_gpu == 0
    assert second.hit_gpu == (1000 - 1) // 16 * 16  # the last token is always computed
    assert second.first_token - second.arrival == pytest.approx(cost.prefill_time(992, 1000), rel=1e-12)


def test_kv_pressure_preempts_and_every_request_still_finishes():
    wl = ListWorkload([spec(i, 0.0, tokens(10 + i, 500), 1000) for i in range(6)])
    run = simulate(one(kv_capacity_tokens=4096), wl)
    rep = run.replicas[0]
    assert rep.stats.num_preemptions > 0
    assert all(r.failed is None and r.finish > r.first_token for r in run.requests)
    assert sum(r.num_preemptions for r in run.requests) == rep.stats.num_preemptions
    assert rep.cache.num_used_blocks == 0  # nothing left pinned or reserved
    assert not rep.running and not rep.waiting


def test_request_larger_than_the_kv_pool_fails_with_a_reason():
    wl = ListWorkload([spec(0, 0.0, tokens(1, 5000), 10), spec(1, 0.0, tokens(2, 100), 10)])
    run = simulate(one(kv_capacity_tokens=4096), wl)
    big, small = run.requests
    assert big.failed is not None and "KV capacity" in big.failed
    assert small.failed is None


def test_client_timeout_aborts_queued_and_running_requests_and_frees_their_kv():
    wl = ListWorkload([spec(i, 0.0, tokens(20 + i, 1500), 200) for i in range(40)])
    run = simulate(one(kv_capacity_tokens=16384, request_timeout_s=1.0), wl)
    failed = [r for r in run.requests if r.failed == "timeout"]
    assert 0 < len(failed) < len(run.requests)
    assert any(r.first_token > 0 for r in failed)  # some were aborted mid-decode
    assert all(r.finish - r.arrival == pytest.approx(1.0) for r in failed)
    assert all(r.finish - r.arrival < 1.0 for r in run.requests if r.failed is None)


def test_client_concurrency_cap_holds_requests_at_the_client():
    wl = ListWorkload([spec(i, 0.0, tokens(40 + i, 300), 20) for i in range(12)])
    run = simulate(one(max_in_flight=3), wl)
    sends = sorted(r.arrival for r in run.requests)
    finishes = sorted(r.finish for r in run.requests)
    assert sends[:3] == [0.0, 0.0, 0.0]
    assert sends[3:] == pytest.approx(finishes[:9])  # each later send follows a completion
    assert max(r.replica for r in run.requests) == 0 and all(r.failed is None for r in run.requests)
    assert run.replicas[0].cache.num_used_blocks == 0


def test_same_inputs_give_the_same_run():
    wl = ListWorkload([spec(i, i * 0.01, tokens(i % 3, 700), 50) for i in range(60)])
    a = simulate(FleetConfig(num_replicas=3, model_preset=PRESET, policy="random", seed=7), wl)
    b = simulate(FleetConfig(num_replicas=3, model_preset=PRESET, policy="random", seed=7), wl)
    assert [(r.replica, r.first_token, r.finish) for r in a.requests] == [
        (r.replica, r.first_token, r.finish) for r in b.requests
    ]
    c = simulate(FleetConfig(num_replicas=3, model_preset=PRESET, policy="random", seed=8), wl)
    assert [r.replica for r in a.requests] != [r.replica for r in c.requests]
