"""The named benchmark runs: llm-d's shapes, scaled or not, and the scheduler files they share with the
simulator."""

from __future__ import annotations

from pathlib import Path

from kvmesh.bench.presets import (
    LLMD_37_SCHEDULERS,
    LLMD_73_SCHEDULERS,
    LLMD_SCALED_KV_CAPACITY,
    LLMD_SCHEDULERS,
    PRESETS,
)
from kvmesh.router.scheduler import load_scheduler_config
from kvmesh.sim import presets as sim_presets
from kvmesh.workload import SharedPrefixWorkload


def test_llmd_presets_state_their_scaling():
    full = PRESETS["llmd-73"]()
    assert isinstance(full.workload, SharedPrefixWorkload)
    assert (full.workload.num_groups, full.workload.system_prompt_len, full.workload.question_len) == (
        150,
        6000,
        1200,
    )
    assert len(full.workload.stages or []) == 17
    scaled = PRESETS["llmd-73-scaled"]()
    assert scaled.kv_capacity_tokens == LLMD_SCALED_KV_CAPACITY == 307_328 * 40 // 150
    assert "40 groups" in scaled.description and "20 output tokens" in scaled.description
    for path in scaled.scheduler_configs.values():
        assert Path(path).is_file()


def test_live_runs_and_the_simulator_read_one_scheduler_source():
    assert {p: LLMD_73_SCHEDULERS[p] for p in ("approximate", "load")} == LLMD_SCHEDULERS
    for files, configs in (
        (LLMD_73_SCHEDULERS, sim_presets.LLMD_SCHEDULERS),
        (LLMD_37_SCHEDULERS, sim_presets.LLMD_37_SCHEDULERS),
    ):
        assert set(files) == set(configs) == {"llmd-precise", "approximate", "load", "random"}
        for policy, source in files.items():
            assert configs[policy] == load_scheduler_config(source)


def _weights(config: dict) -> dict[str, float]:
    (profile,) = config["schedulingProfiles"]
    return {p["pluginRef"]: p["weight"] for p in profile["plugins"] if "weight" in p}


def test_llmd_scheduler_weights_and_routing_history_size():
    s73, s37 = sim_presets.LLMD_SCHEDULERS, sim_presets.LLMD_37_SCHEDULERS
    assert _weights(s73["llmd-precise"]) == {
        "precise-prefix-cache-scorer": 3,
        "kv-cache-utilization-scorer": 2,
        "queue-scorer": 2,
    }
    assert set(_weights(s73["approximate"]).values()) == {1}
    assert _weights(s37["llmd-precise"])["precise-prefix-cache-scorer"] == 2
    assert _weights(s37["approximate"])["prefix-cache-scorer"] == 2
    assert s37["load"] == s73["load"] and s37["random"] == s73["random"]
    for config in (s73["approximate"], s37["approximate"]):
        (prefix,) = [p for p in config["plugins"] if p["type"] == "prefix-cache-scorer"]
        assert prefix["parameters"] == {"blockSize": 64, "lruCapacity": 500_000}
