"""``kvmesh bench run`` and ``kvmesh bench compare``.

``run`` drives a workload against a URL (any OpenAI-compatible endpoint) or against a fleet it
launches; ``compare`` launches one fleet and runs the workload once per router policy, resetting
caches between runs, and prints llm-d's comparison table.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from rich.console import Console

from kvmesh.errors import ConfigError

_POLICIES = "random,load,approximate,precise"


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a fleet or any OpenAI-compatible endpoint")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")

    run = sub.add_parser("run", help="run one workload against --url or a launched fleet")
    _workload_args(run)
    _fleet_args(run)
    run.add_argument("--url", default=None, help="existing endpoint; without it a fleet is launched")
    run.add_argument("--metrics-url", action="append", default=[], help="engine URL whose /metrics to sample")
    run.add_argument("--policy", default="precise", help="router policy of the launched fleet")
    _output_args(run)
    run.set_defaults(func=_cmd_run)

    cmp_ = sub.add_parser("compare", help="one fleet, one run per router policy, llm-d's table")
    _workload_args(cmp_)
    _fleet_args(cmp_)
    cmp_.add_argument("--policies", default=_POLICIES, help=f"comma-separated (default {_POLICIES})")
    cmp_.add_argument(
        "--router-presets",
        action="store_true",
        help="use the router's own presets even where the workload preset names the published weights",
    )
    _output_args(cmp_)
    cmp_.set_defaults(func=_cmd_compare)

    bench.set_defaults(func=lambda _args: (bench.print_help(), 2)[1])


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        default="llmd-73-scaled-quick",
        help="a preset (llmd-73, llmd-73-scaled, llmd-73-scaled-quick, agentic-scaled, agentic-scaled-2x) or a workload YAML file",
    )
    p.add_argument("--trace", type=Path, default=None, help="replay a Mooncake-format jsonl trace instead")
    p.add_argument("--speedup", type=float, default=1.0, help="trace replay speed-up factor")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N trace lines")
    p.add_argument(
        "--concurrency", type=int, default=None, help="closed loop with N workers (default: open loop)"
    )
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--model-name", default="", help="the request's model field (default: from /v1/models)")


def _fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engines", type=int, default=None, help="engine replicas (default: the preset's, else 2)"
    )
    p.add_argument("--model", default="smollm2", help="engine --model")
    p.add_argument("--emulate", default=None, help="engine --emulate PRESET (default: the workload preset's)")
    p.add_argument("--shared", choices=["dir", "redis", "valkey", "none"], default="dir")
    p.add_argument(
        "--emulated-store",
        action="store_true",
        help="emulated engines use the shared tier too (placeholder KV, modelled load times)",
    )
    p.add_argument("--engine-arg", action="append", default=[], help="extra engine flags (quoted)")
    p.add_argument("--router-arg", action="append", default=[], help="extra router flags (quoted)")
    p.add_argument("--router-config", default=None, help="router YAML (replaces --policy)")
    p.add_argument("--run-dir", type=Path, default=None, help="logs and shared tier (default: a temp dir)")


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", dest="json_path", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--requests-json", action="store_true", help="include every request in the JSON")
    p.add_argument("--plot-dir", type=Path, default=None, help="write TTFT CDF and per-stage PNG plots here")
    p.add_argument("--no-progress", action="store_true")


def _resolve_workload(args: argparse.Namespace) -> tuple[Any, Any]:
    from kvmesh.bench.presets import PRESETS
    from kvmesh.workload import MooncakeTraceWorkload, load_workload

    if args.trace is not None:
        return MooncakeTraceWorkload(args.trace, speedup=args.speedup, max_requests=args.max_requests), None
    if args.workload in PRESETS:
        scaled = PRESETS[args.workload]()
        return scaled.workload, scaled
    path = Path(args.workload)
    if not path.is_file():
        raise ConfigError(
            f"--workload {args.workload!r} is neither a preset ({', '.join(PRESETS)}) nor a file"
        )
    return load_workload(path), None


def _fleet_config(args: argparse.Namespace, scaled: Any, policy: str) -> Any:
    from kvmesh.fleet import FleetConfig, split_args

    engine_args = split_args(args.engine_arg)
    emulate = args.emulate or (scaled.emulate if scaled is not None else None)
    if scaled is not None and scaled.kv_capacity_tokens and "--kv-capacity-tokens" not in engine_args:
        engine_args += ["--kv-capacity-tokens", str(scaled.kv_capacity_tokens)]
    return FleetConfig(
        num_engines=args.engines or (scaled.num_engines if scaled is not None else 2),
        model=args.model,
        emulate=emulate,
        shared=args.shared,
        policy=policy,
        router_config=args.router_config,
        engine_args=engine_args,
        router_args=split_args(args.router_arg),
        run_dir=args.run_dir,
        emulated_store=args.emulated_store,
    )


def _options(args: argparse.Namespace, label: str) -> Any:
    from kvmesh.bench.runner import RunOptions

    return RunOptions(
        base_url="",
        model=args.model_name,
        api=args.api,
        concurrency=args.concurrency,
        progress=not args.no_progress,
        label=label,
    )


def _emit(args: argparse.Namespace, runs: dict[str, Any], console: Console) -> None:
    from kvmesh.bench.report import plot_stage_curves, plot_ttft_cdf, print_runs, write_json

    print_runs(runs, console)
    if args.json_path is not None:
        write_json(args.json_path, runs, include_requests=args.requests_json)
        console.print(f"results: {args.json_path}")
    if args.plot_dir is not None:
        cdf = plot_ttft_cdf(runs, args.plot_dir / "ttft_cdf.png")
        curves = plot_stage_curves(runs, args.plot_dir / "ttft_throughput_vs_qps.png")
        console.print(f"plots: {cdf} {curves}")


def _cmd_run(args: argparse.Namespace) -> int:
    from kvmesh.bench.compare import run_on_fleet, served_model
    from kvmesh.bench.report import make_console
    from kvmesh.bench.runner import run_workload
    from kvmesh.fleet import Fleet

    console = make_console()
    workload, scaled = _resolve_workload(args)
    if scaled is not None:
        console.print(f"[dim]{scaled.description}[/dim]")
    options = _options(args, args.policy if args.url is None else "run")

    async def main() -> dict[str, Any]:
        if args.url is not None:
            options.base_url = args.url
            options.metrics_urls = list(args.metrics_url)
            if not options.model:
                options.model = await served_model(args.url) or "default"
            return {options.label: await run_workload(workload, options)}
        async with Fleet(_fleet_config(args, scaled, args.policy)) as fleet:
            console.print(
                f"[dim]fleet up: router {fleet.url}, {len(fleet.engines)} engines, run dir {fleet.run_dir}[/dim]"
            )
            return {options.label: await run_on_fleet(fleet, workload, options)}

    runs = asyncio.run(main())
    _emit(args, runs, console)
    return 0 if all(r.summary.num_ok for r in runs.values()) else 1


def _cmd_compare(args: argparse.Namespace) -> int:
    from kvmesh.bench.compare import compare_policies
    from kvmesh.bench.report import make_console, ratio_lines
    from kvmesh.fleet import Fleet

    console = make_console()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError("--policies is empty")
    workload, scaled = _resolve_workload(args)
    if scaled is not None:
        console.print(f"[dim]{scaled.description}[/dim]")
    options = _options(args, "compare")

    async def main() -> dict[str, Any]:
        async with Fleet(_fleet_config(args, scaled, policies[0])) as fleet:
            console.print(f"[dim]fleet up: {len(fleet.engines)} engines, run dir {fleet.run_dir}[/dim]")
            configs = scaled.scheduler_configs if scaled is not None and not args.router_presets else {}
            return await compare_policies(fleet, workload, policies, options, scheduler_configs=configs)

    runs = asyncio.run(main())
    _emit(args, runs, console)
    for line in ratio_lines(runs, policies[-1], policies[:-1]):
        console.print(line)
    return 0
