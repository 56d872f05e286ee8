"""The cost model's formulas, checked against hand-computed values."""

from __future__ import annotations

import pytest

from kvmesh.engine.cost_model import PRESETS, CostModel, causal_pairs, get_preset


def test_causal_pairs_is_sum_of_positions() -> None:
    assert causal_pairs(0, 4) == 1 + 2 + 3 + 4
    assert causal_pairs(2, 5) == 3 + 4 + 5
    assert causal_pairs(7, 7) == 0
    with pytest.raises(ValueError, match="start <= end"):
        causal_pairs(5, 2)


def test_qwen_prefill_matches_formula() -> None:
    cost = CostModel(get_preset("qwen3-32b-h100-tp2"))
    m = cost.model
    n = 7200
    flops = 2 * 31.2e9 * n + 4 * 64 * 64 * 128 * (n * (n + 1) // 2)
    expected = flops / (989.5e12 * 2 * 0.45) + 1.5e-3
    assert cost.prefill_time(0, n) == pytest.approx(expected, rel=1e-12)
    assert m.kv_bytes_per_token == 256 * 1024
    # Chunking pays one step overhead per chunk and the same FLOPs in total.
    chunks = -(-n // 8192)
    assert cost.cold_prefill_time(n) == pytest.approx(expected + (chunks - 1) * 1.5e-3)
    assert cost.cold_prefill_time(n, chunk=2048) == pytest.approx(
        sum(cost.prefill_time(s, min(n, s + 2048)) for s in range(0, n, 2048))
    )


def test_qwen_fleet_prefill_rate_is_near_the_anchor() -> None:
    # BENCHMARKS-ANCHORS: 8 × TP2 Qwen3-32B pods do about 93k prefill tok/s in total.
    cost = CostModel(get_preset("qwen3-32b-h100-tp2"))
    fleet = 8 * 7200 / cost.cold_prefill_time(7200)
    assert 80_000 < fleet < 110_000


def test_decode_step_is_memory_bound_and_grows_with_context() -> None:
    cost = CostModel(get_preset("qwen3-32b-h100-tp2"))
    m = cost.model
    one = cost.decode_step_time([1000])
    expected = (m.weight_bytes + 1000 * m.kv_bytes_per_token) / (3.35e12 * 2 * 0.8) + 1.5e-3
    assert one == pytest.approx(expected)
    assert cost.decode_step_time([8000] * 32) > cost.decode_step_time([8000] * 8) > one


def test_mixed_step_costs_more_than_either_part_and_less_than_both() -> None:
    cost = CostModel(get_preset("llama-3.1-8b-h100"))
    prefill = cost.step_time([(0, 2000)], [])
    decode = cost.step_time([], [4000] * 16)
    mixed = cost.step_time([(0, 2000)], [4000] * 16)
    assert max(prefill, decode) < mixed < prefill + decode
    assert cost.step_time([], []) == 0.0


def test_kv_load_time_per_tier() -> None:
    cost = CostModel(get_preset("qwen3-32b-h100-tp2"))
    assert cost.kv_load_time(6000, "GPU") == 0.0
    link = cost.preset.tier_links["SHARED"]
    assert cost.kv_load_time(6000, "shared") == pytest.approx(
        link.latency + 6000 * 256 * 1024 / link.bandwidth
    )
    assert cost.kv_load_time(6000, "CPU") < cost.kv_load_time(6000, "DISK")
    assert cost.kv_load_time(0, "DISK") == 0.0
    with pytest.raises(ValueError, match="no link"):
        cost.kv_load_time(10, "TAPE")


def test_capacities() -> None:
    assert CostModel(get_preset("qwen3-32b-h100-tp2")).kv_capacity_tokens() == 307_328
    cost = CostModel(get_preset("llama-3.1-8b-h100"))
    m, p = cost.model, cost.preset
    free = 80e9 * 0.9 - m.weight_bytes - p.activation_reserve_bytes
    assert cost.kv_capacity_tokens() == int(free // (128 * 1024))
    for preset in PRESETS.values():
        assert CostModel(preset).kv_capacity_tokens() > 10_000


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="qwen3-32b-h100-tp2"):
        get_preset("gpt-9")


def test_emulated_runner_charges_the_cost_model() -> None:
    from kvmesh.engine.emulated_runner import EmulatedRunner
    from kvmesh.engine.runner import PrefillChunk, SamplingParams, Sequence, StepPlan

    runner = EmulatedRunner("qwen3-32b-h100-tp2")
    cost = runner.cost
    cold = Sequence("a", list(range(7200)), 7200, SamplingParams())
    assert runner.step_seconds(StepPlan([PrefillChunk(cold, 0, 7200)])) == cost.prefill_time(0, 7200)
    warm = Sequence("b", list(range(7200)), 7200, SamplingParams())
    plan = StepPlan([PrefillChunk(warm, 6000, 7200, cached_tier="SHARED")])
    assert runner.step_seconds(plan) == pytest.approx(
        cost.prefill_time(6000, 7200) + cost.kv_load_time(6000, "SHARED")
    )
    local = StepPlan([PrefillChunk(warm, 6000, 7200, cached_tier="GPU")])
    assert runner.step_seconds(local) == pytest.approx(cost.prefill_time(6000, 7200))
    decoding = Sequence("c", list(range(101)), 100, SamplingParams(), num_computed_tokens=100)
    mixed = StepPlan([PrefillChunk(cold, 0, 7200)], [decoding])
    assert runner.step_seconds(mixed) == cost.step_time([(0, 7200)], [101])


def test_cli_lists_presets(capsys) -> None:
    from kvmesh.cli import main

    assert main(["engine", "--list-presets"]) == 0
    out = capsys.readouterr().out
    assert "307,328" in out and "tiny-h100" in out
