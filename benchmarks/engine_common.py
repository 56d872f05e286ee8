"""Helpers shared by the engine benchmarks: start ``kvmesh engine`` processes, time streamed requests."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp


@dataclass(slots=True)
class EngineProcess:
    proc: asyncio.subprocess.Process
    url: str
    info: dict[str, Any]

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def start_engine(*args: str, timeout: float = 300.0) -> EngineProcess:
    """Run ``kvmesh engine ARGS --port 0`` and wait for its ready line."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvmesh", "engine", *args, "--port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    if not line:
        await proc.wait()
        raise RuntimeError(f"kvmesh engine {' '.join(args)} exited with {proc.returncode}")
    info = json.loads(line)
    return EngineProcess(proc, info["url"], info)


@dataclass(slots=True)
class Timing:
    ttft: float
    e2e: float
    num_tokens: int
    cached_tokens: int


async def timed_completion(
    http: aiohttp.ClientSession, url: str, prompt: str | list[int], max_tokens: int, **extra: Any
) -> Timing:
    """Stream one completion; TTFT is the first SSE chunk after the send (vLLM bench's definition)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    start = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with http.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
    e2e = time.perf_counter() - start
    assert ttft is not None
    return Timing(
        ttft,
        e2e,
        int(usage.get("completion_tokens", 0)),
        int(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)),
    )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
