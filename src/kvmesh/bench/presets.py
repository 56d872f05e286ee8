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

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvmesh.workload import AgenticWorkload, SharedPrefixWorkload, Stage, Workload

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


def llmd_73_workload(
    *, output_len: int = 1000, vocab_size: int = SMOLLM2_VOCAB, name: str = "llmd-73"
) -> SharedPrefixWorkload:
    """llm-d 73-capacity's requests: 150 groups × 5 prompts, 6000 + 1200 prompt tokens, the published
    Poisson stages; the load runner and the simulator both build it here."""
    return SharedPrefixWorkload(
        num_groups=150,
        num_prompts_per_group=5,
        system_prompt_len=6000,
        question_len=1200,
        output_len=output_len,
        stages=[dataclasses.replace(stage) for stage in LLMD_STAGES],
        arrival="poisson",
        vocab_size=vocab_size,
        name=name,
    )


def repeated_prompts(
    name: str, groups: int, per_group: int, cycles: int, lengths: tuple[int, int, int]
) -> SharedPrefixWorkload:
    """``groups`` × ``per_group`` prompts with SmolLM2-valid ids, the whole set sent ``cycles`` times:
    the real-model demos' workload. ``lengths``: system prompt, question and output tokens."""
    system, question, output = lengths
    return SharedPrefixWorkload(
        num_groups=groups,
        num_prompts_per_group=per_group,
        system_prompt_len=system,
        question_len=question,
        output_len=output,
        num_requests=cycles * groups * per_group,
        vocab_size=SMOLLM2_VOCAB,
        seed=1,
        name=name,
    )


def llmd_73() -> ScaledRun:
    """llm-d's 73-capacity benchmark, unscaled."""
    w = llmd_73_workload()
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


AGENTIC_SCALED_ENGINES = 4
AGENTIC_SCALED_KV_CAPACITY = 12_288
"""Per-pod KV of ``agentic-scaled``: the 4 pods hold about 0.6 of the live sessions' contexts, as the
8 × Qwen3-32B fleet of ``kvmesh/sim/examples/agentic.yaml`` holds about 0.55 of its sessions'."""


def agentic_scaled(*, seed: int = 0, load: float = 1.0) -> ScaledRun:
    """Coding-agent sessions (:class:`AgenticWorkload`) scaled to emulated engines on one 2-core machine.

    The shape of ``kvmesh/sim/examples/agentic.yaml`` (shared system prompt and tools, growing contexts
    about 93% seen before, heavy-tailed tool results, think times after each turn, compaction at the
    cap) with contexts of a few thousand tokens instead of tens of thousands, so that SmolLM2's
    8,192-token context (what emulated engines load) holds them: 24 sessions, 6,144-token cap, about
    570 requests of 3,300 tokens on average and 16-token outputs; about a minute per scheduler.
    ``load`` scales how many sessions run at once (an agent is a closed loop: its load is
    concurrency): ``load`` × 24 sessions starting ``1 / load`` s apart.
    """
    w = AgenticWorkload(
        num_sessions=round(24 * load),
        session_interval_s=1.0 / load,
        system_prompt_len=1024,
        task_len={"median": 400, "sigma": 0.6, "min": 50, "max": 2000},
        num_turns={"median": 20, "sigma": 0.5, "min": 10, "max": 60},
        output_len={"median": 16, "sigma": 0.6, "min": 4, "max": 64},
        tool_result_len={"median": 100, "sigma": 1.2, "min": 5, "max": 3000},
        think_time_s={"median": 0.5, "sigma": 1.0, "min": 0.05, "max": 10.0},
        max_context_tokens=6144,
        summary_len={"mean": 600, "std_dev": 150, "min": 200, "max": 1200},
        block_tokens=256,
        seed=seed,
        vocab_size=SMOLLM2_VOCAB,
        name="agentic-scaled" + ("" if load == 1.0 else f"-{load:g}x"),
    )
    desc = (
        f"coding-agent sessions scaled: {w.num_sessions} sessions about {w.mean_session_interval_s:g} s apart, "
        f"median 20 turns, contexts capped at {w.max_context_tokens:,} tokens (example: 128k) with compaction, "
        f"{AGENTIC_SCALED_ENGINES} pods of {AGENTIC_SCALED_KV_CAPACITY:,} KV tokens"
    )
    return ScaledRun(w, AGENTIC_SCALED_ENGINES, "qwen3-32b-h100-tp2", AGENTIC_SCALED_KV_CAPACITY, desc)


PRESETS: dict[str, Callable[[], ScaledRun]] = {
    "llmd-73": llmd_73,
    "llmd-73-scaled": llmd_73_scaled,
    "llmd-73-scaled-demo": lambda: llmd_73_scaled("demo"),
    "llmd-73-scaled-quick": lambda: llmd_73_scaled("quick"),
    "agentic-scaled": agentic_scaled,
    "agentic-scaled-2x": lambda: agentic_scaled(load=2.0),
}
"""``kvmesh bench ... --workload NAME`` accepts these names as well as YAML files."""
