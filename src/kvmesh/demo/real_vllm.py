"""Part 1 of ``kvmesh demo`` on real vLLM: the same replicas with and without kvmesh.

Two fleets of vLLM servers (the CPU build, one per core) serve one shared-prefix workload:

- **round-robin, vLLM's own prefix cache**: what a plain load balancer in front of vLLM gives;
- **kvmesh**: kvmesh's router (precise routing from vLLM's own KV events) in front of the same
  replicas, which also load and save KV chunks in a shared directory through ``KVMeshConnector``.

Each replica's KV is capped (``--num-gpu-blocks-override``) so it holds about two of the four groups'
system prompts, as in llm-d's capacity benchmarks: a replica that serves every group keeps evicting.
Afterwards one long prompt is computed on one kvmesh replica and sent to the other, which loads it
from the shared directory: cold TTFT against loaded TTFT, same first token.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from rich.console import Console

from kvmesh.bench.compare import run_on_fleet
from kvmesh.bench.metrics import RunResult
from kvmesh.bench.presets import repeated_prompts
from kvmesh.bench.report import describe_ratio
from kvmesh.bench.runner import RunOptions
from kvmesh.fleet import Fleet, FleetConfig, SharedTier
from kvmesh.integrations.store_bridge import StoreBridge
from kvmesh.workload import SharedPrefixWorkload

KV_BLOCKS = 12
"""KV blocks of 128 tokens per replica: two groups' 512-token system prompts plus the requests in
flight fit, four groups do not."""
SYSTEM_PROMPT_LEN = 512
QUESTION_LEN = 32
OUTPUT_LEN = 4
NUM_GROUPS = 4
CYCLES = 3
PROBE_TOKENS = 1280

SETUPS: tuple[tuple[str, str, SharedTier], ...] = (
    ("round-robin, vLLM prefix cache", "round-robin", "none"),
    ("kvmesh router + shared store", "precise", "dir"),
)
"""(label, router policy, shared tier) of the two vLLM fleets."""


def replicas(quick: bool, requested: int | None) -> int:
    """One replica per core on this class of machine: 2 unless asked otherwise."""
    return requested or 2


def workload(quick: bool) -> SharedPrefixWorkload:
    """Four groups of twelve questions, every prompt sent three times (144 requests): the four cold
    first requests and the ones that queue behind them are a few percent, so the top decile that
    sets p90 TTFT (14 requests) is warm-path traffic, not a handful of cold starts (3 questions per
    group with ``quick``)."""
    per_group = 3 if quick else 12
    lengths = (SYSTEM_PROMPT_LEN, QUESTION_LEN, OUTPUT_LEN)
    return repeated_prompts("demo-vllm-shared-prefix", NUM_GROUPS, per_group, CYCLES, lengths)


def fleet_configs(num_replicas: int, base_dir: Path) -> list[FleetConfig]:
    """The two vLLM fleets, in :data:`SETUPS` order."""
    return [
        FleetConfig(
            num_engines=num_replicas,
            model="smollm2",
            engine="vllm",
            shared=shared,
            policy=policy,
            run_dir=base_dir / f"vllm-{policy}",
            engine_args=["--num-gpu-blocks-override", str(KV_BLOCKS), "--max-model-len", "1408"],
        )
        for _label, policy, shared in SETUPS
    ]


@dataclass(slots=True)
class CrossReplicaProbe:
    """One long prompt: computed on replica A, then served by replica B from the shared store."""

    prompt_tokens: int
    cold_ttft_s: float
    loaded_ttft_s: float
    loaded_tokens: int
    same_first_token: bool

    def to_dict(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cold_ttft_s": round(self.cold_ttft_s, 4),
            "loaded_ttft_s": round(self.loaded_ttft_s, 4),
            "loaded_tokens": self.loaded_tokens,
            "same_first_token": self.same_first_token,
        }


async def stream_first_token(
    session: aiohttp.ClientSession, url: str, prompt: list[int]
) -> tuple[float, str, int, int]:
    """(TTFT, text, prompt tokens, cached tokens) of one greedy one-token streamed completion."""
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = float("nan")
    text = ""
    usage: dict[str, object] = {}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if text == "" and ttft != ttft:
                    ttft = time.perf_counter() - start
                text += chunk["choices"][0].get("text", "")
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    prompt_tokens = usage.get("prompt_tokens", 0)
    return ttft, text, int(prompt_tokens) if isinstance(prompt_tokens, int) else 0, cached


async def cross_replica_probe(fleet: Fleet, *, timeout_s: float = 120.0) -> CrossReplicaProbe:
    """Compute a fresh long prompt on engine 0, then time engine 1 loading it from the store.

    Engine 1 is asked once the shared directory holds the prompt's chunks (engine 0 writes them in
    the background after its forward pass).
    """
    prompt = [1000 + (i * 7919) % 40_000 for i in range(PROBE_TOKENS + 37)]
    a, b = fleet.engines[0].url, fleet.engines[1].url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        cold_ttft, cold_text, n, _ = await stream_first_token(session, a, prompt)
        await asyncio.to_thread(wait_for_store, fleet, prompt, timeout_s)
        loaded_ttft, loaded_text, _, cached = await stream_first_token(session, b, prompt)
    return CrossReplicaProbe(n, cold_ttft, loaded_ttft, cached, cold_text == loaded_text)


def wait_for_store(fleet: Fleet, prompt: list[int], timeout_s: float) -> int:
    """Wait until the shared store holds every whole chunk of ``prompt`` (a timeout only costs the
    probe its hits); returns the tokens found."""
    assert fleet.store_url is not None and fleet.vllm_replicas
    namespace = fleet.vllm_replicas[0].store_namespace()
    bridge = StoreBridge(fleet.store_url, lookup_timeout_s=2.0)
    try:
        want = (len(prompt) - 1) // bridge.chunk_size * bridge.chunk_size
        deadline = time.monotonic() + timeout_s
        while True:
            found = bridge.lookup(prompt, namespace)
            if found >= want or time.monotonic() > deadline:
                return found
            time.sleep(0.2)
    finally:
        bridge.close()


async def run(
    console: Console, fleets: list[Fleet], num_replicas: int, *, quick: bool, progress: bool
) -> tuple[dict[str, RunResult], CrossReplicaProbe | None]:
    """Both fleets in turn (each started when its run begins and stopped after it), then the
    cross-replica probe on kvmesh's."""
    load = workload(quick)
    console.rule(f"[bold]1. real vLLM: {num_replicas} vLLM replicas (CPU build) serving SmolLM2-135M")
    console.print(
        f"[dim]{load.num_groups} groups × {load.num_prompts_per_group} prompts, {SYSTEM_PROMPT_LEN}-token system "
        f"prompt + {QUESTION_LEN}-token question, {OUTPUT_LEN} output tokens; every prompt sent {CYCLES} times "
        f"({load.num_requests} requests), {num_replicas} concurrent clients; {KV_BLOCKS} KV blocks of 128 tokens "
        f"per replica[/dim]"
    )
    runs: dict[str, RunResult] = {}
    probe: CrossReplicaProbe | None = None
    for (label, _policy, _shared), fleet in zip(SETUPS, fleets, strict=True):
        await fleet.start()
        opts = RunOptions(
            base_url=fleet.url, model="smollm2", concurrency=num_replicas, progress=progress, label=label
        )
        runs[label] = await run_on_fleet(fleet, load, opts)
        if fleet.store_url is not None and len(fleet.engines) >= 2:
            probe = await cross_replica_probe(fleet)
        await fleet.aclose()
    return runs, probe


def explain(base: RunResult, best: RunResult, probe: CrossReplicaProbe | None, num_replicas: int) -> str:
    """What the vLLM numbers mean, in a user's terms."""
    b, k = base.summary, best.summary
    ttft90 = b.ttft.p90 / k.ttft.p90 if k.ttft.p90 else float("inf")
    ttft50 = b.ttft.median / k.ttft.median if k.ttft.median else float("inf")
    thr = k.request_throughput / b.request_throughput if b.request_throughput else float("inf")
    ideal = k.reusable_tokens / k.prompt_tokens if k.prompt_tokens else 0.0
    text = (
        f"An ideal fleet-wide cache could have served {ideal:.0%} of the prompt tokens. Round-robin in front of "
        f"{num_replicas} vLLM replicas sent every group to every replica; each, with room for about two groups, kept "
        f"evicting: vLLM's own prefix cache served {b.reusable_hit_rate:.0%} of the reusable tokens. kvmesh's router "
        f"read vLLM's KV events and sent each prompt to the replica holding its prefix, and KVMeshConnector let a "
        f"replica load chunks another had computed: {k.reusable_hit_rate:.0%} of the reusable tokens came from "
        f"cache; {describe_ratio(ttft50, 'median TTFT', 'lower', 'higher')}, "
        f"{describe_ratio(ttft90, 'p90 TTFT', 'lower', 'higher')}, throughput {thr:.2f}x."
    )
    if probe is not None:
        speedup = probe.cold_ttft_s / probe.loaded_ttft_s if probe.loaded_ttft_s else float("inf")
        text += (
            f"\nOne {probe.prompt_tokens}-token prompt computed on replica 0, then sent to replica 1: TTFT "
            f"{probe.cold_ttft_s:.2f} s cold, {probe.loaded_ttft_s:.2f} s with {probe.loaded_tokens} tokens loaded "
            f"from the shared store ({speedup:.1f}x faster); first token "
            f"{'identical' if probe.same_first_token else 'DIFFERENT'}."
        )
    return text
