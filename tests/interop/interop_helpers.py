"""Clients and process helpers for the interop suite (plain HTTP, as a user's client would talk)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.fleet.process import ManagedProcess
from kvmesh.fleet.vllm import VllmReplica

START_TIMEOUT_S = 420.0


@dataclass
class LiveVllm:
    """A running vLLM server and how to reach it."""

    replica: VllmReplica
    proc: ManagedProcess

    @property
    def url(self) -> str:
        return self.replica.url


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 300.0) -> Any:
    """GET (or POST ``body``) and decode JSON."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def metric(base_url: str, name: str) -> float:
    """The sum of every sample of ``name`` in ``base_url``/metrics."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Completion:
    ttft_s: float
    text: str
    prompt_tokens: int
    cached_tokens: int
    endpoint: str | None


def complete(
    base_url: str, prompt: str | list[int], max_tokens: int = 1, model: str = "smollm2"
) -> Completion:
    """One greedy streamed completion; TTFT is the first streamed chunk with text, as vLLM's bench measures."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"{base_url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    ttft: float | None = None
    text = ""
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        endpoint = resp.headers.get("x-kvmesh-endpoint")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - start
                text += chunk["choices"][0].get("text", "")
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        ttft_s=ttft if ttft is not None else float("nan"),
        text=text,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens") or 0),
        endpoint=endpoint,
    )


def wait_healthy(live: LiveVllm, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        live.proc.check_alive()
        try:
            with urllib.request.urlopen(f"{live.url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{live.proc.name} not healthy after {timeout_s:.0f}s:\n{live.proc.log_tail(40)}"
            )
        time.sleep(1.0)


def stop(proc: ManagedProcess) -> None:
    asyncio.run(proc.stop(grace_s=15.0))


def kvmesh_command(*args: str) -> list[str]:
    """The ``kvmesh`` CLI of the virtualenv running the tests."""
    return [str(Path(sys.executable).parent / "kvmesh"), *args]
