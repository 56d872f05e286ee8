"""``kvmesh demo``: what a shared cache plus cache-aware routing does to a fleet, on one machine.

Part 1, a real model. SmolLM2-135M replicas on CPU serve a shared-prefix workload twice:

- baseline: round-robin routing, each replica with only its own prefix cache;
- kvmesh: precise (KV-event) routing, plus a shared-directory store every replica reads and writes.

The replicas are real vLLM servers (the CPU build, ``KVMeshConnector`` for the store) wherever vLLM
runs; elsewhere, or with ``--engine kvmesh``, kvmesh's reference engine, and the demo says so. With
vLLM it also times one long prompt computed on one replica and loaded by another.

Part 2, an emulated llm-d fleet: 8 pods with Qwen3-32B TP2 H100 cost models serve llm-d's
73-capacity workload, scaled to this machine (see :mod:`kvmesh.bench.presets`), once per scheduler:
random, load, approximate, precise.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmesh.bench.compare import compare_policies, run_on_fleet
from kvmesh.bench.metrics import RunResult
from kvmesh.bench.presets import llmd_73_scaled, repeated_prompts
from kvmesh.bench.report import (
    SummaryColumn,
    compare_table,
    describe_ratio,
    plot_stage_curves,
    plot_ttft_cdf,
    ratio_lines,
    runs_table,
    write_json,
)
from kvmesh.bench.runner import RunOptions
from kvmesh.demo import real_vllm
from kvmesh.errors import FleetError
from kvmesh.fleet import EngineKind, Fleet, FleetConfig, SharedTier
from kvmesh.fleet.vllm import vllm_unavailable_reason
from kvmesh.workload import SharedPrefixWorkload

EMULATED_POLICIES = ("random", "load", "approximate", "llmd-precise", "precise")
"""llm-d's four schedulers (its precise weights as ``llmd-precise``) and kvmesh's default."""


@dataclass(slots=True)
class DemoOptions:
    quick: bool = False
    replicas: int | None = None
    real: bool = True
    emulated: bool = True
    run_dir: Path | None = None
    json_path: Path | None = None
    plot_dir: Path | None = None
    progress: bool = True
    engine: EngineKind | None = None
    """Real-model replicas: ``None`` picks vLLM where it runs, the kvmesh engine elsewhere."""


def resolve_engine(options: DemoOptions) -> tuple[EngineKind, str | None]:
    """The real-model engine to use, and why vLLM is not used when it is not.

    Raises:
        FleetError: vLLM was asked for explicitly and cannot run here.
    """
    if options.engine == "kvmesh":
        return "kvmesh", "--engine kvmesh"
    reason = vllm_unavailable_reason()
    if reason is None:
        return "vllm", None
    if options.engine == "vllm":
        raise FleetError(f"--engine vllm: {reason}")
    return "kvmesh", reason


REAL_SYSTEM_PROMPT_LEN = 256
REAL_QUESTION_LEN = 16
REAL_OUTPUT_LEN = 4
REAL_KV_CAPACITY_TOKENS = 512
"""Per-replica device-tier KV, in tokens: one group's system prompt and questions fit, two do not.
As in llm-d's benchmark, the fleet's resident prompt set fits in the fleet's KV only when each group
stays on one replica; a replica that serves every group (round-robin) keeps evicting."""


def real_cycles(quick: bool, num_replicas: int) -> int:
    """How many times each prompt is sent: 3 (2 with ``quick``, or with 2 replicas, where the third
    occurrence would land where the first did under round-robin)."""
    return 2 if quick or num_replicas <= 2 else 3


def real_workload(quick: bool, num_replicas: int) -> SharedPrefixWorkload:
    """The real-model workload: about one group of prompts per replica, every prompt sent 2-3 times.

    The number of prompts is chosen so that round-robin never sends a repeated prompt to the replica
    that served an earlier occurrence of it (no accidental per-replica repeat hits).
    """
    cycles = real_cycles(quick, num_replicas)
    groups, per_group = num_replicas, 2 if quick else 4
    if num_replicas > 1:
        groups, per_group = min(
            ((g, q) for g in range(groups, groups + 2 * num_replicas) for q in range(per_group, per_group + 2)
             if all((k * g * q) % num_replicas for k in range(1, cycles))),
            key=lambda gq: (gq[0] * gq[1], gq),
        )  # fmt: skip
    lengths = (REAL_SYSTEM_PROMPT_LEN, REAL_QUESTION_LEN, REAL_OUTPUT_LEN)
    return repeated_prompts("demo-shared-prefix", groups, per_group, cycles, lengths)


_REAL_COLUMNS: list[SummaryColumn] = [
    ("hit rate", lambda s: f"{s.hit_rate:.3f}"),
    ("of reusable", lambda s: f"{s.reusable_hit_rate:.3f}"),
    ("TTFT p50 s", lambda s: f"{s.ttft.median:.3f}"),
    ("TTFT p90 s", lambda s: f"{s.ttft.p90:.3f}"),
    ("req/s", lambda s: f"{s.request_throughput:.2f}"),
    ("out tok/s", lambda s: f"{s.output_throughput:.1f}"),
    ("failed", lambda s: str(s.num_failed)),
]


def _real_table(runs: dict[str, RunResult], title: str = "real model: SmolLM2-135M replicas on CPU") -> Table:
    return runs_table(runs, _REAL_COLUMNS, title=title, label_header="setup")


def explain_real(base: RunResult, best: RunResult, num_replicas: int) -> str:
    """One paragraph on what the real-model numbers mean."""
    b, k = base.summary, best.summary
    ttft = b.ttft.p90 / k.ttft.p90 if k.ttft.p90 else float("inf")
    ttft50 = b.ttft.median / k.ttft.median if k.ttft.median else float("inf")
    thr = k.request_throughput / b.request_throughput if b.request_throughput else float("inf")
    ideal = k.reusable_tokens / k.prompt_tokens if k.prompt_tokens else 0.0
    return (
        f"An ideal fleet-wide cache could have served {ideal:.0%} of the prompt tokens. Round-robin spread each "
        f"group's system prompt over all {num_replicas} replicas; each replica, with KV room for about one group, "
        f"kept evicting and recomputing what another had already computed: it served {b.reusable_hit_rate:.0%} "
        f"of the reusable tokens (1/{num_replicas} = {1 / num_replicas:.0%}). Precise routing sent each prompt to the replica whose KV events showed its "
        f"prefix, and the shared directory let any replica load chunks another had written: {k.reusable_hit_rate:.0%} "
        f"of the reusable tokens came from cache; {describe_ratio(ttft50, 'median TTFT', 'lower', 'higher')}, "
        f"{describe_ratio(ttft, 'p90 TTFT', 'lower', 'higher')}, throughput {thr:.2f}x."
    )


REAL_SETUPS: tuple[tuple[str, str, SharedTier], ...] = (
    ("round-robin, per-replica caches", "round-robin", "none"),
    ("precise + shared store", "precise", "dir"),
)
"""(label, router policy, shared tier) of the two real-model fleets."""


def _real_replicas(options: DemoOptions) -> int:
    return options.replicas or (3 if options.quick else 4)


def real_fleet_configs(options: DemoOptions, base_dir: Path) -> list[FleetConfig]:
    """The two real-model fleets of part 1, in :data:`REAL_SETUPS` order."""
    return [
        FleetConfig(
            num_engines=_real_replicas(options),
            model="smollm2",
            shared=shared,
            policy=policy,
            run_dir=base_dir / policy,
            engine_args=["--kv-capacity-tokens", str(REAL_KV_CAPACITY_TOKENS)],
        )
        for _label, policy, shared in REAL_SETUPS
    ]


def emulated_fleet_config(options: DemoOptions, base_dir: Path) -> FleetConfig:
    """The 8-pod emulated fleet of part 2."""
    scaled = llmd_73_scaled("quick" if options.quick else "demo")
    return FleetConfig(
        num_engines=scaled.num_engines,
        model="smollm2",
        emulate=scaled.emulate,
        shared="none",
        policy=EMULATED_POLICIES[0],
        engine_args=["--kv-capacity-tokens", str(scaled.kv_capacity_tokens)],
        run_dir=base_dir / "emulated",
    )


async def run_real(options: DemoOptions, console: Console, fleets: list[Fleet]) -> dict[str, RunResult]:
    """Part 1: round-robin without sharing vs precise routing with the shared store.

    Each fleet is started when its run begins and stopped once it is done.
    """
    n = _real_replicas(options)
    workload = real_workload(options.quick, n)
    console.rule(f"[bold]1. real model: {n} SmolLM2-135M replicas, shared-prefix workload")
    console.print(
        f"[dim]{workload.num_groups} groups × {workload.num_prompts_per_group} prompts, {REAL_SYSTEM_PROMPT_LEN}-token "
        f"system prompt + {REAL_QUESTION_LEN}-token question, {REAL_OUTPUT_LEN} output tokens; every prompt sent "
        f"{real_cycles(options.quick, n)} times ({workload.num_requests} requests), {n} concurrent clients; {REAL_KV_CAPACITY_TOKENS} KV tokens "
        f"per replica[/dim]"
    )
    runs: dict[str, RunResult] = {}
    for (label, _policy, _shared), fleet in zip(REAL_SETUPS, fleets, strict=True):
        await fleet.start()
        opts = RunOptions(base_url=fleet.url, model="", concurrency=n, progress=options.progress, label=label)
        runs[label] = await run_on_fleet(fleet, workload, opts)
        await fleet.aclose()
    console.print(_real_table(runs))
    console.print(explain_real(runs[REAL_SETUPS[0][0]], runs[REAL_SETUPS[1][0]], n))
    return runs


async def run_emulated(options: DemoOptions, console: Console, fleet: Fleet) -> dict[str, RunResult]:
    """Part 2: llm-d's four schedulers and kvmesh's, 8 emulated Qwen3-32B pods, scaled (the fleet is
    started here and stopped at the end)."""
    scaled = llmd_73_scaled("quick" if options.quick else "demo")
    console.rule("[bold]2. emulated llm-d fleet: 8 pods Qwen3-32B TP2 H100, llm-d's schedulers and kvmesh's")
    console.print(f"[dim]{scaled.description}[/dim]")
    await fleet.start()
    opts = RunOptions(base_url=fleet.url, model="", progress=options.progress, label="emulated")
    runs = await compare_policies(
        fleet, scaled.workload, EMULATED_POLICIES, opts, scheduler_configs=scaled.scheduler_configs
    )
    await fleet.aclose()
    console.print(compare_table(runs, title="emulated llm-d 73-capacity (scaled): scheduler comparison"))
    for line in ratio_lines(runs, "precise", ["random", "load", "approximate", "llmd-precise"]):
        console.print(line)
    return runs


HIGH_HOST_LOAD = 0.25
"""Share of the machine's CPU time used by other work above which emulated timings are distorted."""


@dataclass(frozen=True, slots=True)
class HostLoad:
    """CPU time other processes used while the demo was idle, and the 1-minute load average."""

    busy_fraction: float
    load_avg_1m: float
    num_cpus: int

    @property
    def high(self) -> bool:
        return self.busy_fraction > HIGH_HOST_LOAD


def _cpu_times() -> tuple[int, int]:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values[:8]), idle


async def measure_host_load(seconds: float = 2.0) -> HostLoad | None:
    """Sample /proc/stat over ``seconds`` while the demo itself idles (``None`` where unreadable)."""
    try:
        total0, idle0 = _cpu_times()
        await asyncio.sleep(seconds)
        total1, idle1 = _cpu_times()
    except (OSError, ValueError, IndexError):
        return None
    total = max(total1 - total0, 1)
    return HostLoad(1.0 - (idle1 - idle0) / total, os.getloadavg()[0], os.cpu_count() or 1)


def describe_host_load(load: HostLoad) -> str:
    text = (
        f"host load before the demo started anything: {load.busy_fraction:.0%} of {load.num_cpus} cores busy with other "
        f"work (1-min load average {load.load_avg_1m:.2f})"
    )
    if load.high:
        text += (
            " — [bold yellow]high[/bold yellow]: emulated engines sleep by a GPU cost model but their "
            "bookkeeping and the router share these cores, so queues form where an H100 fleet would have "
            "none; the gaps between schedulers below are smaller than on an idle machine"
        )
    return text


async def run_demo(options: DemoOptions, console: Console) -> int:
    """Measure the host's load, then run each part on fleets started when the part begins.

    The load is measured before any fleet exists, so it is other people's work only; each fleet is
    stopped when its part ends, so no fleet idles on the cores while another one is measured.

    Returns:
        0 when every run completed requests, 1 otherwise.
    """
    t0 = time.monotonic()
    base_dir = options.run_dir or Path(f"/tmp/kvmesh-demo-{int(time.time())}")
    engine, why_not_vllm = resolve_engine(options) if options.real else ("kvmesh", None)
    num_vllm = real_vllm.replicas(options.quick, options.replicas)
    load = await measure_host_load() if options.emulated else None
    if load is not None:
        console.print(describe_host_load(load))
    if not options.real:
        real_fleets: list[Fleet] = []
    elif engine == "vllm":
        real_fleets = [Fleet(c) for c in real_vllm.fleet_configs(num_vllm, base_dir)]
    else:
        console.print(
            f"[yellow]real-model part runs kvmesh's reference engine, not vLLM: {why_not_vllm}[/yellow]"
        )
        real_fleets = [Fleet(c) for c in real_fleet_configs(options, base_dir)]
    emulated = Fleet(emulated_fleet_config(options, base_dir)) if options.emulated else None
    fleets = [*real_fleets, *([emulated] if emulated is not None else [])]
    all_runs: dict[str, dict[str, RunResult]] = {}
    console.print(f"[dim]logs under {base_dir}[/dim]")
    try:
        if real_fleets and engine == "vllm":
            runs, probe = await real_vllm.run(
                console, real_fleets, num_vllm, quick=options.quick, progress=options.progress
            )
            labels = [label for label, _, _ in real_vllm.SETUPS]
            console.print(
                _real_table(runs, title=f"real vLLM: {num_vllm} replicas (CPU build), SmolLM2-135M")
            )
            console.print(real_vllm.explain(runs[labels[0]], runs[labels[1]], probe, num_vllm))
            all_runs["real"] = runs
            if probe is not None and options.json_path is not None:
                probe_path = options.json_path.with_name(f"{options.json_path.stem}-probe.json")
                probe_path.write_text(json.dumps(probe.to_dict(), indent=2))
        elif real_fleets:
            all_runs["real"] = await run_real(options, console, real_fleets)
        if emulated is not None:
            all_runs["emulated"] = await run_emulated(options, console, emulated)
    finally:
        await asyncio.gather(*(f.aclose() for f in fleets), return_exceptions=True)
    if options.json_path is not None:
        for part, runs in all_runs.items():
            write_json(options.json_path.with_name(f"{options.json_path.stem}-{part}.json"), runs)
    if options.plot_dir is not None:
        for part, runs in all_runs.items():
            plot_ttft_cdf(runs, options.plot_dir / f"demo_{part}_ttft_cdf.png", title=f"TTFT CDF ({part})")
        if "emulated" in all_runs:
            plot_stage_curves(all_runs["emulated"], options.plot_dir / "demo_emulated_vs_qps.png")
    console.print(f"[dim]demo finished in {time.monotonic() - t0:.0f} s[/dim]")
    ok = all(r.summary.num_ok > 0 for runs in all_runs.values() for r in runs.values())
    return 0 if ok else 1
