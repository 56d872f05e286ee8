"""Named workloads: llm-d's published benchmark shapes and the demo's.

``llmd-73`` is llm-d's "73-capacity" run as published (Qwen3-32B, 8 pods × TP2, inference-perf
shared_prefix, 150 groups × 5 prompts, 6000 + 1200 prompt tokens, 1000 output tokens, 17 Poisson
stages from 3 to 60 QPS). It needs a real GPU fleet or the simulator: about 13,000 requests and
13 million output tokens.

``llmd-73-scaled`` keeps what decides the result — prompt lengths, hence prefill cost per request,
and a resident prompt set larger than one pod's KV cache — and shrinks what a 2-core machine cannot
carry: fewer groups (so each pod's KV is cut by the same factor through ``--kv-capacity-tokens``, see
:data:`LLMD_SCALED_KV_CAPACITY`), 1/50 of the output tokens, and a short staircase of stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvmesh.workload import SharedPrefixWorkload, Stage, Workload

LLMD_STAGES = [
    Stage(15, 50, warmup=True),
    Stage(3, 20),
    Stage(10, 20),
    Stage(15, 20),
    Stage(20, 38),
    Stage(22, 34),
    Stage(25, 30),
    Stage(30, 25),
    Stage(35, 21),
    Stage(40, 38),
    Stage(43, 36),
    Stage(46, 33),
    Stage(49, 30),
    Stage(52, 29),
    Stage(55, 27),
    Stage(57, 26),
    Stage(60, 25),
]
"""llm-d 73-capacity: QPS × seconds; the first stage is the warm-up."""

SMOLLM2_VOCAB = 49_152
"""Synthetic token ids stay below this: valid for SmolLM2's tokenizer (what emulated engines load) and
for every larger vocabulary."""
LLMD_KV_CAPACITY = 307_328
"""KV tokens per pod that llm-d measured for Qwen3-32B TP2 on H100."""


@dataclass(frozen=True, slots=True)
class ScaledRun:
    """A workload plus the fleet facts it was scaled with, so reports can state the scaling."""

    workload: Workload
    num_engines: int
    emulate: str | None
    kv_capacity_tokens: int | None
    description: str
    scheduler_configs: dict[str, str] = field(default_factory=dict)
    """Per router policy, a scheduler YAML with the weights the published benchmark used."""


def llmd_73() -> ScaledRun:
    """llm-d's 73-capacity benchmark, unscaled."""
    w = SharedPrefixWorkload(
        num_groups=150,
        num_prompts_per_group=5,
        system_prompt_len=6000,
        question_len=1200,
        output_len=1000,
        stages=list(LLMD_STAGES),
        arrival="poisson",
        vocab_size=SMOLLM2_VOCAB,
        name="llmd-73",
    )
    return ScaledRun(
        w, 8, "qwen3-32b-h100-tp2", None, "llm-d 73-capacity as published", dict(LLMD_SCHEDULERS)
    )


SCHEDULERS_DIR = Path(__file__).with_name("schedulers")
"""Scheduler YAML of llm-d's benchmarks; the simulator's scenarios read the same files."""

LLMD_73_SCHEDULERS: dict[str, str] = {
    "llmd-precise": "llmd-precise",
    "approximate": str(SCHEDULERS_DIR / "llmd-73-approximate.yaml"),
    "load": str(SCHEDULERS_DIR / "llmd-load.yaml"),
    "random": "random",
}
"""llm-d's 73-capacity schedulers, per policy a router preset name or a scheduler YAML path: precise
(prefix from KV events 3, KV utilization 2, queue 2: the router's ``llmd-precise``), approximate
(prefix from routing history + KV utilization + queue, 1:1:1), load (queue + KV utilization) and
random."""

LLMD_37_SCHEDULERS: dict[str, str] = {
    **LLMD_73_SCHEDULERS,
    "llmd-precise": str(SCHEDULERS_DIR / "llmd-37-precise.yaml"),
    "approximate": str(SCHEDULERS_DIR / "llmd-37-approximate.yaml"),
}
"""llm-d's 37-capacity schedulers: both prefix schedulers weighted 2:1:1 (its README's configs)."""

LLMD_SCHEDULERS = {policy: LLMD_73_SCHEDULERS[policy] for policy in ("approximate", "load")}
"""What runs on a live fleet pass to the router in place of its presets of the same names; precise and
random are the router's presets."""

LLMD_SCALED_GROUPS = 40
LLMD_SCALED_KV_CAPACITY = LLMD_KV_CAPACITY * LLMD_SCALED_GROUPS // 150
"""Per-pod KV capacity cut by the same factor as the number of groups (150 → 40), so the resident
prompt set stays at 73 % of the fleet's KV."""


ScaledSize = Literal["full", "demo", "quick"]

LLMD_SCALED_STAGES: dict[str, list[Stage]] = {
    # warm-up issues each of the 200 prompts about once; then a staircase that overloads a fleet
    # without cache hits (about 14 QPS here) by 2-3x, as llm-d's 20-60 QPS stages do.
    "full": [Stage(15, 14, warmup=True), Stage(25, 15), Stage(35, 15), Stage(40, 15)],
    "demo": [Stage(15, 14, warmup=True), Stage(30, 12)],
    "quick": [Stage(12, 5, warmup=True), Stage(25, 5)],
}


def llmd_73_scaled(size: ScaledSize = "full", *, seed: int = 0) -> ScaledRun:
    """llm-d 73-capacity scaled to one 2-core machine (see the module docstring).

    ``full`` is the reproduction recorded in the docs (about 10 minutes for four schedulers);
    ``demo`` and ``quick`` are shorter staircases for ``kvmesh demo`` and ``kvmesh demo --quick``.
    """
    stages = list(LLMD_SCALED_STAGES[size])
    w = SharedPrefixWorkload(
        num_groups=LLMD_SCALED_GROUPS,
        num_prompts_per_group=5,
        system_prompt_len=6000,
        question_len=1200,
        output_len=20,
        stages=stages,
        arrival="poisson",
        seed=seed,
        # emulated engines check ids against their tokenizer (SmolLM2's); the ids' values cost nothing
        vocab_size=SMOLLM2_VOCAB,
        name="llmd-73-scaled" + ("" if size == "full" else f"-{size}"),
    )
    desc = (
        f"llm-d 73-capacity scaled: {LLMD_SCALED_GROUPS} groups × 5 prompts (published 150 × 5), 6000+1200 prompt "
        f"tokens (unchanged), 20 output tokens (1000), per-pod KV {LLMD_SCALED_KV_CAPACITY:,} tokens "
        f"({LLMD_KV_CAPACITY:,}); Poisson stages QPS×s "
        + ", ".join(f"{s.rate:g}×{s.duration:g}" + (" (warm-up)" if s.warmup else "") for s in stages)
    )
    return ScaledRun(w, 8, "qwen3-32b-h100-tp2", LLMD_SCALED_KV_CAPACITY, desc, dict(LLMD_SCHEDULERS))


PRESETS: dict[str, Callable[[], ScaledRun]] = {
    "llmd-73": llmd_73,
    "llmd-73-scaled": llmd_73_scaled,
    "llmd-73-scaled-demo": lambda: llmd_73_scaled("demo"),
    "llmd-73-scaled-quick": lambda: llmd_73_scaled("quick"),
}
"""``kvmesh bench ... --workload NAME`` accepts these names as well as YAML files."""
