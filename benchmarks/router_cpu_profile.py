"""Router CPU per request, and where it goes: ``kvmesh router`` under closed-loop load, profiled.

    .venv/bin/python benchmarks/router_cpu_profile.py [--trees SRC[,SRC...]] [--router-args FLAGS]...
        [--passthrough] [--rounds 3] [--profile [--sample]]

The same minimal backends as ``benchmarks/router_gateway.py`` (answer after 5 ms of waiting) and
its ~500-token text prompts (8 shared system prefixes + distinct questions), sent by 32 closed-loop
clients to one ``kvmesh router --policy precise --tokenizer smollm2`` per source tree. Several
trees (``--trees /tmp/wt-before/src,src``) and flag sets (``--router-args`` repeated) run side by
side in one sitting, their rounds alternating, so a busy machine disturbs each alike;
``--passthrough`` adds the floors of ``router_gateway.py`` (aiohttp; aiohttp's server with the
router's client; asyncio protocols with the router's client). The figure is the router process's
user+system CPU time per answered request (from /proc), which a shared machine disturbs far less
than requests/s.

``--profile`` runs each router under cProfile for the measured phase only (turned on and off by
signal, so start-up and warm-up are not in it) and prints its functions by own time; the CPU
figure of a profiled round is inflated by the profiler and is reported apart. ``--profile
--sample`` samples the router's stack on its CPU time instead, which does not inflate small
functions: CPU µs per request per function, inclusive and self. Every round also prints the
router's CPU per request by thread (user + system).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from router_gateway import MODEL, Procs, closed_loop, cpu_seconds, make_prompts, start_passthroughs, wait_http

from kvmesh.core.net import free_port

_PROFILE_ON, _PROFILE_OFF = signal.SIGUSR1, signal.SIGUSR2


def serve_profiled_router(argv: list[str], profile_out: str) -> None:
    """``kvmesh router`` with cProfile switched on by SIGUSR1 and off (stats written) by SIGUSR2."""
    import cProfile

    from kvmesh.cli import main as kvmesh_main

    # CPU time of the serving thread, not wall time: on a shared machine a niced router is often
    # descheduled mid-call (in a send that wakes its backend, say), which wall time would charge
    # to whatever function it was in.
    profiler = cProfile.Profile(time.thread_time)

    def on(signum: int, frame: object) -> None:
        profiler.enable()

    def off(signum: int, frame: object) -> None:
        profiler.disable()
        profiler.dump_stats(profile_out)

    signal.signal(_PROFILE_ON, on)
    signal.signal(_PROFILE_OFF, off)
    sys.exit(kvmesh_main(["router", *argv]))


def serve_sampled_router(argv: list[str], profile_out: str) -> None:
    """``kvmesh router`` whose stack is sampled on its CPU time (``ITIMER_PROF``) between SIGUSR1
    and SIGUSR2, the samples written to ``profile_out`` as JSON.

    Unlike cProfile this does not slow each call, so the shares of small functions are not inflated;
    a sample lands at the next bytecode boundary of the main thread (time in C code, the event
    loop's included, is charged to the Python function that runs next or called it). The kernel
    fires the timer on its scheduler tick (every 4 ms at HZ=250, not every 1 ms asked), so
    :func:`print_samples` scales the samples to the CPU time measured over the same round.
    """
    import collections
    import json

    from kvmesh.cli import main as kvmesh_main

    stacks: collections.Counter[tuple[str, ...]] = collections.Counter()

    def sample(signum: int, frame: object) -> None:
        names = []
        f = frame
        while f is not None:
            code = f.f_code  # type: ignore[attr-defined]
            names.append(f"{Path(code.co_filename).stem}:{code.co_name}")
            f = f.f_back  # type: ignore[attr-defined]
        stacks[tuple(names)] += 1

    def on(signum: int, frame: object) -> None:
        stacks.clear()
        signal.signal(signal.SIGPROF, sample)
        signal.setitimer(signal.ITIMER_PROF, 0.001, 0.001)

    def off(signum: int, frame: object) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        Path(profile_out).write_text(json.dumps([[list(k), n] for k, n in stacks.items()]))

    signal.signal(_PROFILE_ON, on)
    signal.signal(_PROFILE_OFF, off)
    sys.exit(kvmesh_main(["router", *argv]))


def print_samples(path: Path, requests: float, cpu_s: float, top: int) -> None:
    """Per function: its CPU µs per request while it ran (inclusive) or was on top (self), the
    samples scaled to ``cpu_s``, the CPU time the round took."""
    import collections
    import json

    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for names, n in json.loads(path.read_text()):
        total += n
        own[names[0]] += n
        for name in set(names):
            inclusive[name] += n
    us = 1e6 * cpu_s / max(total, 1) / requests  # per sample, per request
    print(f"{total} samples, {1e3 * cpu_s / max(total, 1):.2f} ms of CPU each")
    print(f"{'inclusive µs':>13} {'self µs':>8}  function (per request)")
    for name, n in inclusive.most_common(top):
        print(f"{n * us:13.1f} {own[name] * us:8.1f}  {name}")
    print("  -- by self time --")
    for name, n in own.most_common(top):
        print(f"{inclusive[name] * us:13.1f} {n * us:8.1f}  {name}")


def thread_cpu(pid: int) -> dict[int, tuple[str, float, float]]:
    """Per thread of ``pid``: its name, user and system CPU seconds (from /proc)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
        except FileNotFoundError:
            continue
        out[int(task.name)] = (name, int(fields[11]) / tick, int(fields[12]) / tick)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--serve-router", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--trees", default="", help="comma-separated src directories, one router each (default: installed)"
    )
    parser.add_argument("--backends", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument(
        "--stream-chunks",
        type=int,
        default=0,
        help="streamed requests, answered with this many SSE token chunks (router_gateway.py's backends)",
    )
    parser.add_argument(
        "--router-args",
        action="append",
        default=None,
        help="kvmesh router flags besides endpoints, port and model (repeat: one router per tree and "
        "flag set; default: --policy precise --tokenizer smollm2)",
    )
    parser.add_argument(
        "--passthrough",
        action="store_true",
        help="add the aiohttp pass-through floor (no parsing, no routing)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="add one profiled round per router and print its top functions"
    )
    parser.add_argument(
        "--sample",
        action="store_true",
        help="with --profile: sample the router's stack each ms of its CPU instead of cProfile",
    )
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    if args.serve_router is not None:
        serve = serve_sampled_router if args.sample else serve_profiled_router
        serve(args.serve_router.split(), args.profile_out)
        return 0

    trees = [t for t in args.trees.split(",") if t] or [""]
    flag_sets = args.router_args or ["--policy precise --tokenizer smollm2"]
    gateway_script = str(Path(__file__).resolve().parent / "router_gateway.py")
    procs = Procs()
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-cpu-profile-"))
    routers: dict[str, tuple[str, int, Path | None]] = {}
    """label -> (URL, pid, where its profile is written; None: not a kvmesh router)"""
    try:
        backend_urls = []
        for _ in range(args.backends):
            port = free_port()
            procs.start(
                [
                    sys.executable,
                    gateway_script,
                    "--serve-backend",
                    str(port),
                    "--stream-chunks",
                    str(args.stream_chunks),
                ]
            )
            backend_urls.append(f"http://127.0.0.1:{port}")
        for url in backend_urls:
            wait_http(f"{url}/health", 30)
        for tree in trees:
            for flags in flag_sets:
                port = free_port()
                env = dict(os.environ, HF_HUB_OFFLINE="1")
                if tree:
                    env["PYTHONPATH"] = str(Path(tree).resolve())
                router_args = (
                    f"--endpoints {','.join(backend_urls)} --port {port} --model {MODEL} --log-level warning "
                    + flags
                )
                out = tmp / f"router-{len(routers)}.prof"
                proc = procs.start(
                    [sys.executable, __file__, "--serve-router", router_args, "--profile-out", str(out)]
                    + (["--sample"] if args.sample else []),
                    env=env,
                )
                wait_http(f"http://127.0.0.1:{port}/health", 120)
                label = (tree or "installed") + (f" [{flags}]" if len(flag_sets) > 1 else "")
                routers[label] = (f"http://127.0.0.1:{port}", proc.pid, out)
        if args.passthrough:
            for label, (url, pid) in start_passthroughs(procs, backend_urls).items():
                routers[label] = (url, pid, None)
        cpu_ms: dict[str, list[float]] = {label: [] for label in routers}
        by_thread: dict[str, dict[str, list[float]]] = {label: {} for label in routers}
        rps: dict[str, list[float]] = {label: [] for label in routers}
        prompts = make_prompts(args.num_prompts, prompt_tokens=args.prompt_tokens)
        labels = list(routers)
        for round_no in range(args.rounds):
            # Each round starts with the next router: none is always first (or right after another).
            for label in labels[round_no % len(labels) :] + labels[: round_no % len(labels)]:
                url, pid, _ = routers[label]
                asyncio.run(closed_loop([url], prompts, 4, args.warmup_s, stream=args.stream_chunks > 0))
                before, threads_before = cpu_seconds(pid), thread_cpu(pid)
                result = asyncio.run(
                    closed_loop(
                        [url], prompts, args.concurrency, args.duration, stream=args.stream_chunks > 0
                    )
                )
                used = cpu_seconds(pid) - before
                served = result["rps"] * args.duration
                cpu_ms[label].append(1e3 * used / served)
                for tid, (name, user, system) in thread_cpu(pid).items():
                    _, user0, system0 = threads_before.get(tid, (name, 0.0, 0.0))
                    key = "main" if tid == pid else name
                    sums = by_thread[label].setdefault(key, [0.0, 0.0])
                    sums[0] += 1e3 * (user - user0) / served / args.rounds
                    sums[1] += 1e3 * (system - system0) / served / args.rounds
                rps[label].append(result["rps"])
        for label, (url, pid, out) in routers.items() if args.profile else ():
            if out is None:
                continue
            asyncio.run(closed_loop([url], prompts, 4, args.warmup_s, stream=args.stream_chunks > 0))
            os.kill(pid, _PROFILE_ON)
            before = cpu_seconds(pid)
            result = asyncio.run(
                closed_loop([url], prompts, args.concurrency, args.duration, stream=args.stream_chunks > 0)
            )
            used = cpu_seconds(pid) - before
            os.kill(pid, _PROFILE_OFF)
            deadline = time.monotonic() + 30
            while not out.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            served = result["rps"] * args.duration
            if args.sample:
                time.sleep(0.5)
                print(f"\n=== {label}: sampled round, {1e3 * used / served:.3f} ms CPU/request")
                print_samples(out, served, used, args.top)
                continue
            print(f"\n=== {label}: profiled round, {1e3 * used / served:.3f} ms CPU/request "
                  f"(profiler included), {served:.0f} requests; per-request times = tottime / {served:.0f}")  # fmt: skip
            time.sleep(0.5)  # the stats file is written by a signal handler; let it finish
            pstats.Stats(str(out)).sort_stats("tottime").print_stats(args.top)
    finally:
        procs.stop_all()
    print("\nrouter CPU ms/request (one figure per round): median, mean; req/s median")
    for label in routers:
        runs = cpu_ms[label]
        print(f"  {label}: {', '.join(f'{c:.3f}' for c in runs)} -> median {statistics.median(runs):.3f}, "
              f"mean {statistics.fmean(runs):.3f} ms; {statistics.median(rps[label]):.0f} req/s")  # fmt: skip
        threads = sorted(by_thread[label].items(), key=lambda kv: -sum(kv[1]))
        print("    by thread, ms/request user + system (mean of rounds): " + "; ".join(
            f"{name} {user:.3f} + {system:.3f}" for name, (user, system) in threads if user + system >= 0.001))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
