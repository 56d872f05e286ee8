"""Named scenarios: llm-d's published capacity benchmarks, ready to simulate side by side.

Each preset fixes the fleet (model, GPUs, pods, KV per pod), the workload (inference-perf's
``shared_prefix`` with the published load stages) and the four schedulers llm-d compared, with
the scorer weights the benchmark used. ``published`` holds the published table so reports can put
simulated and measured figures next to each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvmesh.bench import presets as bench_presets
from kvmesh.engine.cost_model import CostPreset, get_preset
from kvmesh.errors import ConfigError
from kvmesh.router.scheduler import load_scheduler_config
from kvmesh.sim.fleet import FleetConfig
from kvmesh.workload import SharedPrefixWorkload, Stage
from kvmesh.workload.synthetic import DEFAULT_VOCAB_SIZE

if TYPE_CHECKING:
    from kvmesh.bench.metrics import Summary
    from kvmesh.sim.report import SimReport

Aggregation = Literal["pooled", "stages"]
"""``pooled``: percentiles over every request of the run. ``stages``: llm-d's report rows — per-stage
figures (warm-up stage excluded) averaged, p90 and mean TTFT weighted by each stage's requests
(rate × duration), output throughput unweighted."""


LLMD_SCHEDULERS: dict[str, dict[str, Any]] = {
    policy: load_scheduler_config(source) for policy, source in bench_presets.LLMD_73_SCHEDULERS.items()
}
"""The scorer weights of llm-d's 73-capacity benchmark (precise: prefix 3, KV 2, queue 2; approximate:
1 each), read from the scheduler files live benchmark runs use (:mod:`kvmesh.bench.presets`)."""


@dataclass(frozen=True, slots=True)
class Published:
    """One row of a published results table (``None`` where the table has no figure)."""

    output_tok_s: float
    ttft_p90_s: float
    req_s: float | None = None
    ttft_mean_s: float | None = None
    itl_mean_s: float | None = None
    queue_mean: float | None = None


@dataclass(frozen=True, slots=True)
class Headline:
    """A run summarised the way a published table summarises it."""

    ttft_p90_s: float
    output_tok_s: float
    ttft_mean_s: float


@dataclass(frozen=True, slots=True)
class ScenarioPreset:
    """A fleet + workload + schedulers to compare, with the published results they are checked against."""

    name: str
    description: str
    fleet: FleetConfig
    workload: SharedPrefixWorkload
    schedulers: dict[str, dict[str, Any]]
    published: dict[str, Published] = field(default_factory=dict)
    notes: str = ""
    aggregation: Aggregation = "pooled"
    """How the published table summarises a run (see :meth:`aggregate`)."""
    published_stage_p90: dict[str, list[float] | None] = field(default_factory=dict)
    """Published per-stage p90 TTFT (warm-up excluded), where the benchmark's report gives them."""
    published_stage_kv_peak: dict[str, list[float | None]] = field(default_factory=dict)
    """Peak KV-cache usage (0..1) per stage, warm-up included, read off the report's per-pod plots
    (±0.03); ``None`` where the plot has no samples."""

    def headline(self, report: SimReport) -> Headline:
        """The simulated figures comparable with this preset's published row (see ``aggregation``)."""
        return self.aggregate(report.summary, report.run.stages)

    def aggregate(self, run: Summary, stages: Sequence[Summary]) -> Headline:
        """:meth:`headline` from a run's summary and its per-stage summaries."""
        if self.aggregation == "pooled":
            return Headline(run.ttft.p90, run.output_throughput, run.ttft.mean)
        defined = self.workload.stages or []
        weights = {i: s.rate * s.duration for i, s in enumerate(defined) if i > 0}
        rows = [(weights[st.stage], st) for st in stages if st.stage is not None and st.stage in weights]
        if not rows:
            return Headline(float("nan"), float("nan"), float("nan"))
        total = sum(w for w, _ in rows)
        return Headline(
            ttft_p90_s=sum(w * st.ttft.p90 for w, st in rows) / total,
            output_tok_s=sum(st.output_throughput for _, st in rows) / len(rows),
            ttft_mean_s=sum(w * st.ttft.mean for w, st in rows) / total,
        )

    def fleet_for(self, policy: str) -> FleetConfig:
        """The fleet config with ``policy``: one of this preset's schedulers or any policy name."""
        return dataclasses.replace(self.fleet, policy=self.schedulers.get(policy, policy))


PATH_LATENCY_S = 0.25
"""Request path outside the GPU (client, gateway, scheduler, tokenization): the published precise TTFT
has a ≈0.3 s floor even at 3 QPS, where the fleet is idle and every prompt is cached."""

CLIENT_IN_FLIGHT = 1600
"""inference-perf sends from a bounded pool: one worker per client CPU core, 100 requests in flight
each. When the fleet falls behind, due requests wait at the client instead of piling up in the
engines without bound (73's published random/load TTFTs stay near 90 s while the fleet is overloaded
for minutes). TTFT counts from the actual send. 1600 is a 16-core client."""

PREFILL_MFU = 0.55
"""Upper end of the planning range (0.40–0.55): vLLM's chunked prefill of 6–8k-token prompts on H100."""


def _calibrated(name: str) -> CostPreset:
    base = get_preset(name)
    return dataclasses.replace(base, name=f"{name}-mfu{round(PREFILL_MFU * 100)}", mfu=PREFILL_MFU)


def _published_fleet(
    num_replicas: int,
    model_preset: str | CostPreset,
    kv_capacity_tokens: int,
    *,
    drain_stages: bool = False,
    gateways: int = 1,
) -> FleetConfig:
    """An llm-d benchmark fleet: 64-token blocks, metrics every 50 ms, the request path's latency and
    the client's in-flight bound."""
    return FleetConfig(
        num_replicas=num_replicas,
        model_preset=model_preset,
        block_size=64,
        kv_capacity_tokens=kv_capacity_tokens,
        metrics_interval_s=0.05,
        path_latency_s=PATH_LATENCY_S,
        max_in_flight=CLIENT_IN_FLIGHT,
        drain_stages=drain_stages,
        gateways=gateways,
    )


OUTPUT_LEN_73 = 245
"""Mean output tokens per request implied by the published table: 8730 output tok/s ÷ 35.56 req/s."""

LLMD_73 = ScenarioPreset(
    name="llmd-73-capacity",
    description="Qwen3-32B, 8 pods TP2 on H100, 307,328 KV tokens per pod; shared_prefix 150 groups × 5 "
    "prompts, 6000 + 1200 tokens in, 1000 out configured (245 simulated); resident set ≈ 73% of fleet KV",
    fleet=_published_fleet(8, _calibrated("qwen3-32b-h100-tp2"), 307_328),
    # The published stages, warm-up first; a pooled headline counts the warm-up too, as before.
    workload=bench_presets.llmd_73_workload(
        output_len=OUTPUT_LEN_73, vocab_size=DEFAULT_VOCAB_SIZE, name="llmd-73-capacity"
    ),
    schedulers=LLMD_SCHEDULERS,
    published={
        "llmd-precise": Published(8730, 0.542, 35.56, 0.298, 0.026, 0.1),
        "approximate": Published(6944, 31.08, 36.07, 13.32, 0.024, 8.1),
        "load": Published(4266, 94.87, 36.30, 46.99, 0.024, 28.9),
        "random": Published(4429, 92.55, 35.67, 45.28, 0.025, 27.3),
    },
)

LLMD_37_SCHEDULERS: dict[str, dict[str, Any]] = {
    policy: load_scheduler_config(source) for policy, source in bench_presets.LLMD_37_SCHEDULERS.items()
}
"""37-capacity's weights: prefix 2, KV 1, queue 1 for both prefix schedulers (its README's configs)."""

_STAGES_37 = [
    (9, 30),
    (3, 210),
    (4, 180),
    (5, 120),
    (6, 120),
    (8, 90),
    (10, 70),
    (12, 60),
    (15, 50),
    (20, 50),
]
"""37-capacity's constant-rate stages (QPS, seconds); the first is its warm-up. inference-perf finishes
every request of a stage before it starts the next, which this preset simulates (``drain_stages``)."""

GATEWAYS_37 = 2
"""Router replicas inferred for 37-capacity from its KV plots, not stated in its report.

With weights 2/1/1 a single approximate routing history pins each prefix group to the first pod it
went to: that pod's prefix score (2) beats any load advantage (at most 2, and only against an idle
pod), so no group ever gets a second home and the approximate pods would hold *less* KV than the
precise ones (event lag gives precise a few second homes). The report shows the reverse: from 8 QPS
the approximate pods peak at 81–100 % KV, the precise ones at 70–73 %. Two gateways, each with its
own history, give each group about two homes, and the simulated KV peaks then follow the published
ones stage by stage (docs/benchmarks/sim.md); precise, load and random barely change, as their
routing keeps no history."""

LLMD_37 = ScenarioPreset(
    name="llmd-37-capacity",
    description="Llama-3.1-70B, 4 pods TP4 on H100, 461,376 KV tokens per pod; shared_prefix 83 groups × 3 "
    "prompts, 8000 + 1000 tokens in, 1000 out, constant-rate stages 3–20 QPS; the 83 prefixes fill 37% of "
    "the fleet's 224 prefix slots",
    # 461,376 KV tokens: the benchmark's measured "KV_cap (effective, min TP rank)"
    fleet=_published_fleet(4, "llama-3.1-70b-h100-tp4", 461_376, drain_stages=True, gateways=GATEWAYS_37),
    workload=SharedPrefixWorkload(
        num_groups=83,
        num_prompts_per_group=3,
        system_prompt_len=8000,
        question_len=1000,
        output_len=1000,
        stages=[Stage(float(r), float(d)) for r, d in _STAGES_37],
        arrival="constant",
        seed=0,
        name="llmd-37-capacity",
    ),
    schedulers=LLMD_37_SCHEDULERS,
    published={
        "llmd-precise": Published(5650.0, 0.275, 6.914, 0.193, 0.020, 0.2),
        "approximate": Published(5096.2, 7.536, 6.915, 1.549, 0.023, 0.9),
        "load": Published(3018.3, 78.303, 6.920, 41.058, 0.028, 34.2),
        "random": Published(2895.4, 84.623, 6.914, 42.011, 0.028, 34.9),
    },
    aggregation="stages",
    published_stage_p90={
        "llmd-precise": [0.201, 0.277, 0.281, 0.281, 0.280, 0.282, 0.282, 0.288, 0.290],
        "approximate": [0.399, 0.700, 0.900, 0.794, 1.110, 1.309, 1.199, 1.900, 43.568],
        "load": [2.400, 16.101, 28.581, 59.389, 73.762, 86.063, 94.109, 114.672, 173.540],
        "random": [1.502, 23.480, 41.795, 62.490, 78.656, 83.002, 98.661, 139.286, 176.975],
    },
    published_stage_kv_peak={
        "llmd-precise": [0.59, None, None, 0.56, None, None, None, 0.70, 0.73, None],
        "approximate": [0.62, 0.42, 0.50, 0.60, 0.66, 0.81, 0.92, 0.94, 1.00, 1.00],
    },
)

PRESETS: dict[str, ScenarioPreset] = {p.name: p for p in (LLMD_73, LLMD_37)}


def get_scenario(name: str) -> ScenarioPreset:
    """Look a scenario up by name.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown sim preset {name!r}; known: {', '.join(PRESETS)}") from None
