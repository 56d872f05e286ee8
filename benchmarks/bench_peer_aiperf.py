"""Drive a kvmesh fleet with aiperf, a load generator kvmesh did not write.

aiperf runs unchanged against the router's OpenAI endpoint: streaming completions, its synthetic
shared-prefix prompts (``--num-prefix-prompts``/``--prefix-prompt-length``), and the engines'
tokenizer directory (SmolLM2's converted files).

aiperf pins dependencies of its own, so it lives in its own virtualenv::

    python3.11 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0

Usage::

    .venv/bin/python benchmarks/bench_peer_aiperf.py --aiperf .venv-aiperf/bin/aiperf \\
        --engines 2 --emulate tiny-h100 --policy precise --requests 200 --concurrency 8

It prints aiperf's headline figures (read from its JSON export) next to the fleet's own cache hit
counters scraped from every engine's ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.core.models import resolve_model
from kvmesh.fleet import Fleet, FleetConfig

AIPERF_EXPORT = "profile_export_aiperf.json"


def find_aiperf(explicit: str | None) -> str | None:
    """The aiperf executable: ``explicit``, ``$KVMESH_AIPERF``, ``.venv-aiperf/bin/aiperf`` or PATH."""
    for candidate in (explicit, os.environ.get("KVMESH_AIPERF"), ".venv-aiperf/bin/aiperf"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(Path(candidate).resolve())
    return shutil.which("aiperf")


def aiperf_command(
    aiperf: str, url: str, model: str, tokenizer: Path, artifacts: Path, *, requests: int, concurrency: int
) -> list[str]:
    return [
        aiperf, "profile",
        "--model", model,
        "--url", url,
        "--endpoint-type", "completions",
        "--streaming",
        "--tokenizer", str(tokenizer),
        "--concurrency", str(concurrency),
        "--request-count", str(requests),
        "--isl", "64", "--osl", "8",
        "--num-prefix-prompts", "4", "--prefix-prompt-length", "512",
        "--extra-inputs", "ignore_eos:true",
        "--ui", "none", "--no-gpu-telemetry",
        "--artifact-dir", str(artifacts),
    ]  # fmt: skip


def read_export(artifacts: Path) -> dict[str, Any]:
    """aiperf's JSON export (searched under ``artifacts``)."""
    found = sorted(artifacts.rglob(AIPERF_EXPORT))
    if not found:
        raise FileNotFoundError(f"aiperf wrote no {AIPERF_EXPORT} under {artifacts}")
    data: dict[str, Any] = json.loads(found[-1].read_text())
    return data


def headline(export: dict[str, Any]) -> dict[str, float]:
    """request count, throughput and TTFT figures from an aiperf export."""
    out: dict[str, float] = {}
    for key, field in (
        ("request_count", "avg"),
        ("request_throughput", "avg"),
        ("output_token_throughput", "avg"),
        ("time_to_first_token", "avg"),
        ("time_to_first_token", "p90"),
        ("inter_token_latency", "avg"),
    ):
        metric = export.get(key)
        if isinstance(metric, dict) and isinstance(metric.get(field), int | float):
            out[f"{key}.{field}"] = float(metric[field])
    return out


async def fleet_hits(urls: list[str]) -> tuple[float, float]:
    """Sum of ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` over the engines."""
    queries = hits = 0.0
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == "vllm:prefix_cache_queries_total":
                        queries += s.value
                    elif s.name == "vllm:prefix_cache_hits_total":
                        hits += s.value
    return queries, hits


async def run(args: argparse.Namespace) -> dict[str, Any]:
    aiperf = find_aiperf(args.aiperf)
    if aiperf is None:
        raise SystemExit("aiperf not found: pass --aiperf or create .venv-aiperf (see this file's docstring)")
    tokenizer = resolve_model("smollm2").path
    config = FleetConfig(
        num_engines=args.engines,
        model="smollm2",
        emulate=args.emulate or None,
        shared="dir",
        policy=args.policy,
        run_dir=args.run_dir,
    )
    async with Fleet(config) as fleet:
        artifacts = fleet.run_dir / "aiperf"
        cmd = aiperf_command(
            aiperf, fleet.url, "HuggingFaceTB/SmolLM2-135M-Instruct", tokenizer, artifacts,
            requests=args.requests, concurrency=args.concurrency,
        )  # fmt: skip
        env = {
            k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"
        }  # aiperf 0.13 refuses local paths then
        proc = await asyncio.to_thread(
            subprocess.run, cmd, capture_output=True, text=True, timeout=args.timeout, env=env
        )
        if proc.returncode != 0:
            raise SystemExit(
                f"aiperf failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        queries, hits = await fleet_hits(fleet.engine_urls)
        return {
            "command": " ".join(cmd),
            "aiperf": headline(read_export(artifacts)),
            "fleet_prefix_cache_hit_rate": hits / queries if queries else 0.0,
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--aiperf", default=None, help="aiperf executable (default: $KVMESH_AIPERF, .venv-aiperf, PATH)"
    )
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--emulate", default="tiny-h100", help="emulation preset; empty for the real model")
    p.add_argument("--policy", default="precise")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--run-dir", type=Path, default=None)
    args = p.parse_args()
    result = asyncio.run(run(args))
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
