"""``kvmesh sim``: simulate a fleet in virtual time.

    kvmesh sim --preset llmd-73-capacity [--policies precise,random] [--json]
    kvmesh sim --workload W.yaml --replicas 8 --model-preset qwen3-32b-h100-tp2 \\
               [--policies precise] [--shared-tier redis --net-gbps 25]
    kvmesh sim --trace T.jsonl.gz --replicas 8 --model-preset qwen3-32b-h100-tp2 --block-size 64 \\
               [--speedup 2] [--max-requests 3000] [--policies precise,load,random,approximate]
    kvmesh sim sweep --workload W.yaml --model-preset llama-3.1-8b-h100 --replicas 2,4,8 --qps 5,20
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from kvmesh.errors import ConfigError

DEFAULT_POLICIES = "precise,llmd-precise,approximate,load,random"


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "sim",
        help="simulate a fleet in virtual time with the router's own scheduler",
        description="Discrete-event fleet simulator: the engine's cost model and prefix cache, the router's "
        "scheduler and index, the bench's workloads and metrics.",
    )
    _fleet_args(p)
    p.add_argument("--preset", help="a published scenario: llmd-73-capacity or llmd-37-capacity")
    p.add_argument(
        "--policies", default=None, help=f"comma-separated schedulers (default {DEFAULT_POLICIES})"
    )
    p.add_argument("--out", type=Path, help="directory for JSON and plots (ttft_cdf.png, stages.png)")
    p.add_argument("--per-stage", action="store_true", help="print a per-stage table for every run")
    p.set_defaults(func=_run)
    sub = p.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")
    sw = sub.add_parser("sweep", help="fleet size × load, with and without a shared tier")
    _fleet_args(sw)
    sw.add_argument("--policy", default="precise", help="scheduler preset or YAML (default precise)")
    sw.add_argument("--qps", help="comma-separated loads; each replaces the workload's stages")
    sw.add_argument("--duration", type=float, default=120.0, help="seconds of load per point (with --qps)")
    sw.add_argument(
        "--plot", type=Path, default=Path("sim_sweep.png"), help="output PNG (default sim_sweep.png)"
    )
    sw.set_defaults(func=_sweep)


def _fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload", help="workload YAML (bench format: shared_prefix, multi_turn, mooncake, agentic)"
    )
    p.add_argument(
        "--trace", type=Path, default=None, help="replay a Mooncake-format jsonl(.gz) trace instead"
    )
    p.add_argument("--speedup", type=float, default=1.0, help="trace replay speed-up factor")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N trace lines")
    p.add_argument("--replicas", default=None, help="replicas (sweep: comma-separated list)")
    p.add_argument("--model-preset", default="llama-3.1-8b-h100", help="cost-model preset of each replica")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--kv-capacity-tokens", type=int, default=None, help="KV tokens per replica (default: preset)"
    )
    p.add_argument("--cpu-tier-tokens", type=int, default=0, help="per-replica CPU tier size in tokens")
    p.add_argument("--shared-tier", choices=("redis", "valkey", "fs"), default=None)
    p.add_argument("--shared-capacity-tokens", type=int, default=None)
    p.add_argument("--net-gbps", type=float, default=100.0, help="replica NIC towards the shared tier, Gb/s")
    p.add_argument("--store-gbps", type=float, default=None, help="the shared store's NIC, Gb/s")
    p.add_argument(
        "--timeout", type=float, default=None, help="client timeout per request (seconds from send)"
    )
    p.add_argument("--gpu-hour-usd", type=float, default=2.5)
    p.add_argument(
        "--gateways",
        type=int,
        default=None,
        help="router replicas behind a random load balancer, each with its own plugin state "
        "(default 1; with --preset, the preset's)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--flow-control",
        action="store_true",
        help="the router's flow control: requests wait in the router while every replica is saturated "
        "and fail as shed_429 past the deadline (implied by the three options below)",
    )
    p.add_argument(
        "--max-predicted-ttft",
        type=float,
        default=None,
        metavar="S",
        help="flow control: saturated when every replica's predicted TTFT is above S (default 10)",
    )
    p.add_argument(
        "--queue-deadline",
        type=float,
        default=None,
        metavar="S",
        help="flow control: seconds a request may wait in the router before it is shed (default 15)",
    )
    p.add_argument(
        "--max-in-flight-per-replica",
        type=int,
        default=None,
        metavar="N",
        help="flow control: also saturated when every replica has N requests in flight (default off)",
    )
    p.add_argument(
        "--policy-attention-context",
        action="store_true",
        help="keep the policy's attentionContextTokens as the routers' prior instead of the cost "
        "model's figure (to see what the routers learn from it)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _flow_control(args: argparse.Namespace) -> Any:
    """The ``FlowControlConfig`` the flags ask for, or ``None`` (flow control off)."""
    from kvmesh.router.flow_control import FlowControlConfig

    given = {
        "max_predicted_ttft_seconds": args.max_predicted_ttft,
        "max_queue_wait_seconds": args.queue_deadline,
        "max_in_flight_per_endpoint": args.max_in_flight_per_replica,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not args.flow_control and not given:
        return None
    return FlowControlConfig(**given)


def _base_config(args: argparse.Namespace, num_replicas: int, policy: Any) -> Any:
    from kvmesh.sim.fleet import FleetConfig

    return FleetConfig(
        num_replicas=num_replicas,
        model_preset=args.model_preset,
        policy=policy,
        block_size=args.block_size,
        kv_capacity_tokens=args.kv_capacity_tokens,
        cpu_tier_tokens=args.cpu_tier_tokens,
        shared_tier=args.shared_tier,
        shared_capacity_tokens=args.shared_capacity_tokens,
        net_gbps=args.net_gbps,
        store_gbps=args.store_gbps,
        request_timeout_s=args.timeout,
        gpu_hour_usd=args.gpu_hour_usd,
        gateways=1 if args.gateways is None else args.gateways,
        seed=args.seed,
        flow_control=_flow_control(args),
        model_attention_context=not args.policy_attention_context,
    )


def _workload(args: argparse.Namespace) -> Any:
    """The workload of ``--trace`` or ``--workload`` (``None`` when neither is given).

    Raises:
        ConfigError: both given, or trace options without a trace.
    """
    from kvmesh.workload import MooncakeTraceWorkload, load_workload

    if args.trace is None:
        if args.speedup != 1.0 or args.max_requests is not None:
            raise ConfigError("--speedup and --max-requests apply to --trace")
        return load_workload(args.workload) if args.workload else None
    if args.workload:
        raise ConfigError("give --workload or --trace, not both")
    if not args.trace.is_file():
        raise ConfigError(f"--trace {args.trace}: no such file")
    return MooncakeTraceWorkload(args.trace, speedup=args.speedup, max_requests=args.max_requests)


def _err(msg: str) -> int:
    print(f"kvmesh sim: {msg}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvmesh.bench.report import compare_table, plot_stage_curves, plot_ttft_cdf, summary_table
    from kvmesh.sim.fleet import FleetSimulation
    from kvmesh.sim.presets import ScenarioPreset, get_scenario
    from kvmesh.sim.report import SimReport, build_report
    from kvmesh.sim.tables import fleet_table, published_table

    console = Console(stderr=args.json)
    scenario: ScenarioPreset | None = None
    try:
        policies = [p for p in (args.policies or DEFAULT_POLICIES).split(",") if p]
        if args.preset:
            scenario = get_scenario(args.preset)
            workload: Any = scenario.workload
            configs = {p: scenario.fleet_for(p) for p in policies}
            if args.gateways is not None:
                configs = {p: dataclasses.replace(c, gateways=args.gateways) for p, c in configs.items()}
            flow = _flow_control(args)
            if flow is not None:
                configs = {p: dataclasses.replace(c, flow_control=flow) for p, c in configs.items()}
        else:
            workload = _workload(args)
            if workload is None or not args.replicas:
                return _err(
                    "give --preset, or --workload (or --trace) and --replicas (see kvmesh sim --help)"
                )
            n = int(args.replicas)
            if args.policies is None:
                policies = ["precise"]
            configs = {p: _base_config(args, n, p) for p in policies}
    except (ConfigError, ValueError) as exc:
        return _err(str(exc))

    reports: dict[str, SimReport] = {}
    for label, cfg in configs.items():
        try:
            sim = FleetSimulation(cfg)
        except (ConfigError, ValueError) as exc:
            return _err(str(exc))
        with console.status(f"simulating {label} …") as status:

            def progress(done: int, status: Any = status, label: str = label) -> None:
                if done % 1000 == 0:
                    status.update(f"simulating {label} … {done} requests done")

            sim.on_progress = progress
            run = sim.run(workload)
        reports[label] = build_report(run, label)
        if not args.json:
            console.print(
                f"[dim]{label}: {len(run.requests)} requests, {run.duration_s:.0f} s simulated in "
                f"{run.wall_s:.1f} s ({run.num_events} events)[/dim]"
            )
    runs = {k: r.run for k, r in reports.items()}
    if args.json:
        out: dict[str, Any] = {k: r.to_dict() for k, r in reports.items()}
        if scenario is not None:
            out["published"] = {k: vars_of(v) for k, v in scenario.published.items()}
            out["headline"] = {
                k: vars_of(scenario.headline(r)) for k, r in reports.items() if k in scenario.published
            }
            out["aggregation"] = scenario.aggregation
        print(json.dumps(out, indent=2))
    else:
        if args.per_stage:
            for r in runs.values():
                console.print(summary_table(r))
        console.print(compare_table(runs, title=f"simulated: {getattr(workload, 'name', 'workload')}"))
        console.print(fleet_table(reports))
        if scenario is not None:
            console.print(published_table(reports, scenario))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sim.json").write_text(json.dumps({k: r.to_dict() for k, r in reports.items()}, indent=2))
        plot_ttft_cdf(runs, args.out / "ttft_cdf.png")
        plot_stage_curves(runs, args.out / "stages.png")
    return 0


def vars_of(obj: Any) -> dict[str, Any]:
    return {k: getattr(obj, k) for k in obj.__slots__}


def _sweep(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvmesh.sim.sweep import SweepPoint, plot_sweep, run_sweep

    console = Console(stderr=args.json)
    try:
        workload = _workload(args)
        if workload is None:
            return _err("sweep needs --workload or --trace")
        replicas = [int(x) for x in (args.replicas or "2,4,8").split(",") if x]
        qps = [float(x) for x in args.qps.split(",")] if args.qps else None
        base = _base_config(args, replicas[0], args.policy)
    except (ConfigError, ValueError) as exc:
        return _err(str(exc))
    total = len(replicas) * 2 * (len(qps) if qps else 1)
    done: list[SweepPoint] = []

    def progress(point: SweepPoint) -> None:
        done.append(point)
        if not args.json:
            console.print(f"[dim]{len(done)}/{total} {point.report.label}[/dim]")

    try:
        points = run_sweep(
            base,
            workload,
            replicas,
            qps,
            duration_s=args.duration,
            shared_tier=args.shared_tier or "redis",
            on_point=progress,
        )
    except ConfigError as exc:
        return _err(str(exc))
    plot = plot_sweep(
        points, args.plot, title=f"{getattr(workload, 'name', 'workload')} · {args.model_preset}"
    )
    if args.json:
        print(json.dumps({"plot": str(plot), "points": [p.row() for p in points]}, indent=2))
        return 0
    table = Table(title="fleet size sweep")
    for col in (
        "replicas",
        "QPS",
        "shared",
        "TTFT p90",
        "E2E p90",
        "hit rate",
        "$/1k req",
        "shared Gb/s",
        "failed",
    ):
        table.add_column(col, justify="right")
    for p in points:
        r = p.row()
        table.add_row(
            str(p.replicas),
            "-" if p.qps is None else f"{p.qps:g}",
            "yes" if p.shared else "no",
            f"{r['ttft_p90_s']:.3f}",
            f"{r['e2e_p90_s']:.2f}",
            f"{r['hit_rate']:.3f}",
            f"{r['cost_per_1k_usd']:.3f}",
            f"{r['shared_read_gbps']:.2f}",
            str(r["failed"]),
        )
    console.print(table)
    console.print(f"plot: {plot}")
    return 0
