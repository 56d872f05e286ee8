"""Peer routers on one fleet: kvmesh's router presets, sglang-router and vllm-router, side by side.

    .venv/bin/python benchmarks/router_peers.py [--quick] [--policies precise,random]
        [--peers sglang-cache_aware,vllm-cache_aware,vllm-kv_aware] [--shared-store] [--json out.json]

One fleet of 8 engines emulating Qwen3-32B TP2 on H100, started once. In front of it, one router at a
time: ``kvmesh router`` with each preset of ``kvmesh.router.scheduler.PRESET_NAMES`` (``pd`` needs
prefill and decode engines and is left out), then sglang-router ``cache_aware`` and vllm-router
``cache_aware`` and ``kv_aware`` (the latter fed by every engine's ZMQ KV events through
``--kv-event-source``). The peers run from their own virtualenvs (``scripts/install-peers.sh``); a
peer that is not installed is skipped with the reason. Before every run the engines' caches are
emptied (``POST /reset_prefix_cache``; ``--restart-engines`` restarts the engines instead) and the
router is started afresh, so no run inherits another's cache or routing state.

``--shared-store`` gives the engines a shared tier (a directory in the run dir): they write every
prompt's placeholder KV there, load prefixes other pods computed (at the preset's modelled SHARED
load time) and announce the writes as ``SHARED`` KV events. Between runs the directory is emptied
and the engines restart (a fresh process for each run, though the cache-reset route now empties
their own RAM tier as well).

Two workloads, both text through the chat API (the peers' cache-aware policies work on text; vLLM's
asks each worker to render it into ids):

* ``shared-prefix``: llm-d's 73-capacity shape (inference-perf shared_prefix, 6000-token system
  prompts, 1200-token questions, 5 questions per group, 20 output tokens, Poisson arrivals) with
  fewer groups, and the per-pod KV capacity cut by the same factor from llm-d's 307,328 tokens, so the
  prompt set fills 73 % of the fleet's KV and no pod holds more than a fraction of it. A warm-up
  stage sends each prompt about once and is left out of the figures.
* ``multi-turn``: LMCache-style conversations, each turn resending the history plus a new question;
  the histories together outgrow a pod's KV but fit the fleet's.

Token lengths are met in words of SmolLM2's tokenizer (what the emulated engines load), at the
tokens-per-word ratio measured at start. The rate is low enough for one 2-core machine to tokenize
every prompt the routers and engines see (vllm-router has all 8 engines render every request).

Reported per router and workload: the prompt-token hit rate (engine-reported ``cached_tokens``), TTFT
p50/p90, output throughput, failed requests, and the render/tokenize calls the engines answered per
routed request (the router's own preparation work, done on the engines).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from kvmesh.bench.compare import served_model
from kvmesh.bench.metrics import RunResult, Summary
from kvmesh.bench.presets import LLMD_KV_CAPACITY, llmd_73_scaled
from kvmesh.bench.report import make_console
from kvmesh.bench.route_counts import GENERATION_ROUTES, PREPARATION_ROUTES, num_requests, scrape_route_counts
from kvmesh.bench.runner import RunOptions, run_workload
from kvmesh.core.tokens import Tokenizer
from kvmesh.errors import FleetError
from kvmesh.fleet import Fleet, FleetConfig
from kvmesh.fleet.peer_routers import (
    PEER_EVENTS_TOPIC,
    PEER_ROUTERS,
    PeerRouter,
    PeerRouterSpec,
    peer_unavailable_reason,
    start_peer_router,
)
from kvmesh.router.scheduler import PRESET_NAMES
from kvmesh.workload import MultiTurnWorkload, SharedPrefixWorkload, Stage, Workload, synthetic_text

EMULATE = "qwen3-32b-h100-tp2"
NUM_ENGINES = 8
BLOCK_SIZE = 16
LLMD_GROUPS = 150
KVMESH_PRESETS = tuple(p for p in PRESET_NAMES if p != "pd")


@dataclass(frozen=True, slots=True)
class Size:
    """The knobs ``--quick`` turns down."""

    groups: int
    rate: float
    stage_s: float
    conversations: int
    turns: int
    measured_rate: float | None = None
    """QPS of the measured stage (default: ``rate``, the warm-up's)."""
    kv_scale: float = 1.0
    """Per-pod KV relative to llm-d's, cut by the groups factor (below 1: the prompt set outgrows
    the fleet's KV, and only a router that sees evictions knows where prefixes still are)."""


SIZES = {
    "full": Size(groups=16, rate=5.0, stage_s=12.0, conversations=16, turns=5),
    "quick": Size(groups=8, rate=4.0, stage_s=8.0, conversations=8, turns=3),
    # llm-d's scaled shape: 40 groups in 73 % of the fleet's KV, a warm-up that sends each prompt
    # about once, then twice the rate a fleet without cache hits sustains
    "loaded": Size(groups=40, rate=15.0, stage_s=12.0, conversations=16, turns=5, measured_rate=30.0),
    "tight": Size(
        groups=40, rate=15.0, stage_s=12.0, conversations=16, turns=5, measured_rate=30.0, kv_scale=0.5
    ),
}


@dataclass(frozen=True, slots=True)
class RouterChoice:
    """A router under test: a kvmesh preset or a peer configuration."""

    label: str
    kvmesh_policy: str | None = None
    peer: PeerRouterSpec | None = None


@dataclass(slots=True)
class Outcome:
    """One router on one workload: its run, or why it did not run."""

    router: str
    workload: str
    run: RunResult | None = None
    preparation_calls: int = 0
    routed: int = 0
    peer_counters: dict[str, float] = dataclasses.field(default_factory=dict)
    """The peer router's own routing counters (how it prepared and decided), from its /metrics."""
    error: str | None = None


# ---------------------------------------------------------------------------------------------- setup


def tokens_per_word(tokenizer: Tokenizer) -> float:
    """Tokens per word of :func:`synthetic_text` under ``tokenizer``."""
    sample = synthetic_text(random.Random(0), 4000)
    return len(tokenizer.encode(sample, add_special_tokens=False)) / 4000


def kv_capacity_tokens(size: Size) -> int:
    """llm-d's per-pod KV, cut by the same factor as its 150 groups."""
    return int(LLMD_KV_CAPACITY * size.groups * size.kv_scale) // LLMD_GROUPS


def build_workloads(size: Size, ratio: float, seed: int) -> dict[str, tuple[Workload, str]]:
    """The two workloads with their one-line descriptions, lengths given in tokens."""

    def words(tokens: int) -> int:
        return max(1, round(tokens / ratio))

    preset = llmd_73_scaled("full", seed=seed).workload
    assert isinstance(preset, SharedPrefixWorkload), "llmd_73_scaled builds a shared_prefix workload"
    num_prompts = size.groups * preset.num_prompts_per_group
    warmup_s = num_prompts / size.rate
    shared = dataclasses.replace(
        preset,
        num_groups=size.groups,
        system_prompt_len=words(6000),
        question_len=words(1200),
        stages=[
            Stage(size.rate, warmup_s, warmup=True),
            Stage(size.measured_rate or size.rate, size.stage_s),
        ],
        text=True,
        name="shared-prefix",
    )
    shared_desc = (
        f"{size.groups} groups × {preset.num_prompts_per_group} prompts (llm-d: 150 × 5), 6000+1200 prompt tokens, "
        f"20 output tokens; Poisson {size.rate:g} QPS for a {warmup_s:.0f} s warm-up (not reported), then "
        f"{size.measured_rate or size.rate:g} QPS for {size.stage_s:g} s"
    )
    multi = MultiTurnWorkload(
        num_conversations=size.conversations,
        num_turns=size.turns,
        tokens_per_turn=words(450),
        output_len=20,
        system_prompt_len=words(750),
        conversation_interval_s=0.5,
        arrival="poisson",
        seed=seed,
        text=True,
        name="multi-turn",
    )
    multi_desc = (
        f"{size.conversations} conversations × {size.turns} turns, 750-token system prompt, 450 new tokens and "
        "20 output tokens per turn, a conversation every 0.5 s (Poisson), each turn sent when the last one ends"
    )
    return {"shared-prefix": (shared, shared_desc), "multi-turn": (multi, multi_desc)}


def router_choices(policies: list[str], peers: list[str]) -> list[RouterChoice]:
    choices = [RouterChoice(f"kvmesh {p}", kvmesh_policy=p) for p in policies]
    choices += [RouterChoice(PEER_ROUTERS[name].label, peer=PEER_ROUTERS[name]) for name in peers]
    return choices


# ---------------------------------------------------------------------------------------------- runs


async def empty_caches(fleet: Fleet, restart: bool) -> None:
    """Stop the kvmesh router and empty every engine's cache (restart where the reset is refused)
    and the shared tier."""
    await fleet.stop_router()
    await fleet.reset_shared_tier()
    if restart or not await fleet.reset_engine_caches():
        await fleet.start_engines()


async def start_router(fleet: Fleet, choice: RouterChoice, model: str) -> tuple[str, PeerRouter | None]:
    """The URL clients use, and the peer process to stop afterwards (``None`` for kvmesh's router)."""
    if choice.kvmesh_policy is not None:
        config = fleet.config.router_config
        assert config is not None, "the fleet's router reads its preset from a router YAML"
        # A preset by name through the YAML, so presets the CLI's --policy does not list run too
        text = json.dumps({"policy": choice.kvmesh_policy, "tokenizer": "smollm2"})
        await asyncio.to_thread(Path(config).write_text, text)
        await fleet.start_router(choice.kvmesh_policy)
        return fleet.url, None
    assert choice.peer is not None, "a RouterChoice names a kvmesh policy or a peer"
    peer = await start_peer_router(choice.peer, fleet.engines, model=model, block_size=BLOCK_SIZE,
                                   log_dir=fleet.logs_dir)  # fmt: skip
    return peer.url, peer


async def run_one(
    fleet: Fleet,
    choice: RouterChoice,
    name: str,
    workload: Workload,
    model: str,
    *,
    restart: bool,
    progress: bool,
) -> Outcome:
    outcome = Outcome(choice.label, name)
    if choice.peer is not None and (reason := peer_unavailable_reason(choice.peer.kind)) is not None:
        outcome.error = f"skipped: {reason}"
        return outcome
    await empty_caches(fleet, restart)
    try:
        url, peer = await start_router(fleet, choice, model)
    except FleetError as exc:
        outcome.error = f"did not start: {str(exc).splitlines()[0]}"
        return outcome
    try:
        async with aiohttp.ClientSession() as session:
            before = await scrape_route_counts(session, fleet.engine_urls)
            options = RunOptions(base_url=url, model=model, api="chat", metrics_urls=fleet.engine_urls,
                                 progress=progress, label=f"{choice.label} · {name}")  # fmt: skip
            outcome.run = await run_workload(workload, options)
            done = await scrape_route_counts(session, fleet.engine_urls) - before
            if peer is not None:
                outcome.peer_counters = await routing_counters(session, peer.metrics_url)
        outcome.preparation_calls = num_requests(done, PREPARATION_ROUTES)
        outcome.routed = num_requests(done, GENERATION_ROUTES)
    finally:
        if peer is not None:
            await peer.stop()
    fleet.check_alive()
    return outcome


async def routing_counters(session: aiohttp.ClientSession, metrics_url: str) -> dict[str, float]:
    """The ``*routing*`` counters of a peer router's Prometheus page (empty when it does not answer)."""
    try:
        async with session.get(metrics_url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            text = await resp.text() if resp.status == 200 else ""
    except (aiohttp.ClientError, TimeoutError):
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "routing" in sample.name and sample.name.endswith("_total"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


# ---------------------------------------------------------------------------------------------- report


def _summary(outcome: Outcome) -> Summary | None:
    return outcome.run.summary if outcome.run is not None else None


def results_table(outcomes: list[Outcome], title: str) -> Table:
    table = Table(title=title)
    for col in ("workload", "router", "requests", "failed", "hit rate", "TTFT p50 s", "TTFT p90 s",
                "out tok/s", "prep calls/req"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("workload", "router") else "right")
    last = None
    for o in outcomes:
        if last is not None and o.workload != last:
            table.add_section()
        last = o.workload
        s = _summary(o)
        if s is None:
            table.add_row(o.workload, o.router, "-", "-", "-", "-", "-", "-", "-", style="dim")
            continue
        prep = f"{o.preparation_calls / o.routed:.1f}" if o.routed else "-"
        table.add_row(o.workload, o.router, str(s.num_requests), str(s.num_failed), f"{s.hit_rate:.1%}",
                      f"{s.ttft.median:.3f}", f"{s.ttft.p90:.3f}", f"{s.output_throughput:.1f}", prep)  # fmt: skip
    return table


def to_json(outcomes: list[Outcome], config: dict[str, Any]) -> dict[str, Any]:
    runs = []
    for o in outcomes:
        entry: dict[str, Any] = {"workload": o.workload, "router": o.router, "error": o.error}
        if o.run is not None:
            entry["summary"] = msgspec.to_builtins(o.run.summary)
            entry["stages"] = [msgspec.to_builtins(s) for s in o.run.stages]
            entry["routed_requests"] = o.routed
            entry["preparation_calls"] = o.preparation_calls
            entry["peer_counters"] = o.peer_counters
        runs.append(entry)
    return {"config": config, "runs": runs}


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer groups and conversations, shorter stages")
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default=None,
        help="full (default), quick, loaded (llm-d's scaled shape), tight (loaded with half the KV)",
    )
    p.add_argument("--policies", default=",".join(KVMESH_PRESETS),
                   help=f"kvmesh router presets or scheduler YAML files, comma-separated (default: {','.join(KVMESH_PRESETS)})")  # fmt: skip
    p.add_argument("--peers", default=",".join(PEER_ROUTERS),
                   help=f"peer routers, comma-separated, or none (default: {','.join(PEER_ROUTERS)})")  # fmt: skip
    p.add_argument("--workloads", default="shared-prefix,multi-turn")
    p.add_argument("--restart-engines", action="store_true",
                   help="restart the engines between runs instead of emptying their caches in place")  # fmt: skip
    p.add_argument("--shared-store", action="store_true",
                   help="engines share a store directory (placeholder KV, modelled SHARED loads); implies --restart-engines")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument(
        "--run-dir", type=Path, default=None, help="fleet logs (default: a new temporary directory)"
    )
    args = p.parse_args(argv)
    args.policies = [x for x in args.policies.split(",") if x]
    args.peers = [] if args.peers == "none" else [x for x in args.peers.split(",") if x]
    args.workloads = [x for x in args.workloads.split(",") if x]
    args.restart_engines = args.restart_engines or args.shared_store
    files = [x for x in args.policies if x not in PRESET_NAMES and Path(x).is_file()]
    for value, known, flag in ((args.policies, (*PRESET_NAMES, *files), "--policies"), (args.peers, PEER_ROUTERS, "--peers"),
                               (args.workloads, ("shared-prefix", "multi-turn"), "--workloads")):  # fmt: skip
        unknown = sorted(set(value) - set(known))
        if unknown:
            p.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    return args


async def run(args: argparse.Namespace, console: Console) -> tuple[list[Outcome], dict[str, Any]]:
    size_name = args.size or ("quick" if args.quick else "full")
    size = SIZES[size_name]
    ratio = tokens_per_word(Tokenizer.load("smollm2"))
    workloads = {k: v for k, v in build_workloads(size, ratio, args.seed).items() if k in args.workloads}
    capacity = kv_capacity_tokens(size)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="kvmesh-router-peers-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "engines": NUM_ENGINES, "emulate": EMULATE, "kv_capacity_tokens": capacity, "tokens_per_word": ratio,
        "size": size_name, "seed": args.seed, "restart_engines": args.restart_engines, "shared_store": args.shared_store,
        "workloads": {name: desc for name, (_, desc) in workloads.items()},
    }  # fmt: skip
    shared = " + a shared store directory" if args.shared_store else ""
    console.print(f"fleet: {NUM_ENGINES} × {EMULATE} (emulated), {capacity:,} KV tokens per pod{shared}")
    for name, (_, desc) in workloads.items():
        console.print(f"{name}: {desc}")
    fleet_config = FleetConfig(
        num_engines=NUM_ENGINES,
        model="smollm2",
        emulate=EMULATE,
        shared="dir" if args.shared_store else "none",
        emulated_store=args.shared_store,
        start_router=False,
        engine_args=["--kv-capacity-tokens", str(capacity), "--events-topic", PEER_EVENTS_TOPIC],
        router_config=str(run_dir / "router.yaml"),
        run_dir=run_dir,
        health_timeout_s=300,
    )
    outcomes: list[Outcome] = []
    progress = sys.stdout.isatty()
    t0 = time.monotonic()
    async with Fleet(fleet_config) as fleet:
        console.print(f"fleet up in {time.monotonic() - t0:.0f} s; logs in {fleet.logs_dir}")
        model = await served_model(fleet.engine_urls[0]) or "default"
        for choice in router_choices(args.policies, args.peers):
            for name, (workload, _) in workloads.items():
                started = time.monotonic()
                outcome = await run_one(fleet, choice, name, workload, model,
                                        restart=args.restart_engines, progress=progress)  # fmt: skip
                outcomes.append(outcome)
                s = _summary(outcome)
                note = outcome.error or (
                    f"hit rate {s.hit_rate:.1%}, TTFT p90 {s.ttft.p90:.3f} s, {s.num_failed} failed"
                    if s
                    else ""
                )
                console.print(f"{choice.label} · {name}: {note} ({time.monotonic() - started:.0f} s)")
    config["wall_s"] = round(time.monotonic() - t0, 1)
    return outcomes, config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = make_console()
    outcomes, config = asyncio.run(run(args, console))
    title = f"Peer routers on one fleet: {NUM_ENGINES} × {EMULATE} (emulated), {config['kv_capacity_tokens']:,} KV tokens per pod"
    order = {name: i for i, name in enumerate(config["workloads"])}
    console.print(results_table(sorted(outcomes, key=lambda o: order[o.workload]), title))
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(outcomes, config), indent=2))
        console.print(f"results: {args.json}")
    return 0 if all(o.run is not None or (o.error or "").startswith("skipped") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
