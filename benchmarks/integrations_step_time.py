"""vLLM's step time with KVMeshConnector saves running and without, on real vLLM (CPU build).

    .venv/bin/python benchmarks/integrations_step_time.py [--rounds 4] [--prompt-tokens 1024] [--json]

Two vLLM servers (float32 SmolLM2-135M, both bound to core 0, ``KVMeshConnector`` on one Valkey)
start once: one saves computed prompt chunks (``save: true``), the other only looks up
(``save: false``). Each round, on each server in turn (the order alternates), a greedy decode
stream runs while ``--prompts`` fresh prompts of ``--prompt-tokens`` tokens are prefilled one after
another beside it; on the saving server each of those prompts is copied out and stored. The decode
stream's inter-token latency is vLLM's step time as a client sees it. Reported: the median over
rounds of each server's mean inter-token latency, and their ratio (target: at most 1.1).

``--connector-src DIR`` loads the connector from another checkout's ``src`` (a before/after run).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import redis
from rich.console import Console
from rich.progress import Progress

from kvmesh.core.models import resolve_model
from kvmesh.core.net import free_ports
from kvmesh.fleet.process import ManagedProcess
from kvmesh.fleet.vllm import VllmReplica
from kvmesh.store.local_server import LocalServer

START_TIMEOUT_S = 600.0


def prompt_ids(seed: int, num_tokens: int) -> list[int]:
    """A fresh prompt of token ids (nothing shares a prefix with another seed's)."""
    return [1000 + (seed * 104_729 + i * 7919) % 40_000 for i in range(num_tokens)]


async def decode_token_times(
    session: aiohttp.ClientSession, url: str, seed: int, max_tokens: int
) -> list[float]:
    """Arrival times of each streamed token of one greedy decode that ignores EOS."""
    body = {
        "model": "smollm2",
        "prompt": prompt_ids(seed, 32),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]" and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())
    return times


async def prefill(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> None:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        await resp.read()


async def one_round(session: aiohttp.ClientSession, url: str, seed: int, args: argparse.Namespace) -> float:
    """Mean inter-token latency (s) of a decode stream while fresh prompts are prefilled beside it."""
    decode = asyncio.create_task(decode_token_times(session, url, seed, args.decode_tokens))
    await asyncio.sleep(0.2)  # the decode is running before the first prompt arrives
    for i in range(args.prompts):
        await prefill(session, url, prompt_ids(seed * 100 + i + 1, args.prompt_tokens))
    times = await decode
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.fmean(gaps)


async def wait_healthy(session: aiohttp.ClientSession, proc: ManagedProcess, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        proc.check_alive()
        try:
            async with session.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} not healthy after {START_TIMEOUT_S:.0f}s:\n{proc.log_tail(40)}")
        await asyncio.sleep(1.0)


async def measure(args: argparse.Namespace, console: Console, logs: Path) -> dict[str, object]:
    model_dir = resolve_model("smollm2").path
    valkey = LocalServer("valkey").start()
    procs: dict[str, tuple[ManagedProcess, str]] = {}
    try:
        ports = free_ports(2)
        for port, (mode, save) in zip(ports, (("saves", "true"), ("no_saves", "false")), strict=True):
            replica = VllmReplica(
                name=f"vllm-{mode}",
                port=port,
                model_dir=model_dir,
                store=valkey.url,
                cpu_core=0,
                connector_extra=(("save", save),),
            )
            env = replica.env()
            if args.connector_src:
                env["PYTHONPATH"] = args.connector_src
            proc = ManagedProcess(replica.name, replica.argv(), logs / f"{replica.name}.log", env=env)
            proc.start()
            procs[mode] = (proc, replica.url)
        rows: list[dict[str, float]] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
            for proc, url in procs.values():
                await wait_healthy(session, proc, url)
                await prefill(session, url, prompt_ids(99_999, 64))  # first-request warm-up
            with Progress(console=console) as progress:
                task = progress.add_task("rounds", total=args.rounds)
                for r in range(args.rounds):
                    order = ("saves", "no_saves") if r % 2 == 0 else ("no_saves", "saves")
                    row = {}
                    for mode in order:
                        seed = 1000 * (r + 1) + (1 if mode == "saves" else 2)
                        row[mode] = await one_round(session, procs[mode][1], seed, args)
                    rows.append(row)
                    console.print(f"round {r}: " + ", ".join(f"{m} {v * 1e3:.1f} ms" for m, v in row.items()))
                    progress.advance(task)
        stored_keys = redis.Redis(host="127.0.0.1", port=valkey.port).dbsize()
    finally:
        for proc, _ in procs.values():
            await proc.stop(grace_s=15.0)
        valkey.close()
    med = {mode: statistics.median(row[mode] for row in rows) for mode in ("saves", "no_saves")}
    return {
        "rounds": args.rounds,
        "prompts_per_round": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "connector_src": args.connector_src,
        "median_itl_s": med,
        "saves_over_no_saves": med["saves"] / med["no_saves"],
        "store_keys": int(stored_keys),
        "runs": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="prompts prefilled beside each decode")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--connector-src", help="load kvmesh from this src directory instead")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/kvmesh-step-time"))
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    if args.connector_src:
        args.connector_src = str(Path(args.connector_src).resolve())
    console = Console(stderr=True)
    result = asyncio.run(measure(args, console, args.logs))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    med = result["median_itl_s"]
    assert isinstance(med, dict)
    console.print(
        f"mean inter-token latency, median of {args.rounds} rounds: with saves {med['saves'] * 1e3:.1f} ms, "
        f"without {med['no_saves'] * 1e3:.1f} ms, ratio {result['saves_over_no_saves']:.3f} "
        f"({result['store_keys']} keys stored)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
