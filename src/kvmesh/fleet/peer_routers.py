"""Peer routers in front of kvmesh engines: sglang-router and vllm-router, each from its own virtualenv.

Each peer is a Rust router shipped as a Python wheel; ``scripts/install-peers.sh`` installs them into
``.venv-sglang-router`` and ``.venv-vllm-router`` at the repository root (their pins conflict with
kvmesh's), or ``$KVMESH_SGLANG_ROUTER_VENV`` / ``$KVMESH_VLLM_ROUTER_VENV`` name other virtualenvs.
The engines need nothing peer-specific beyond :mod:`kvmesh.engine.peer_api`, with one exception:
vllm-router subscribes to the event streams named by ``--kv-event-source`` with the empty topic, so
the engines behind a ``kv_aware`` router given those flags run with ``--events-topic ''``
(:data:`PEER_EVENTS_TOPIC`). Without the flags it discovers each stream and its topic from the
engine's ``/kv_event_sources``.

::

    router = await start_peer_router(PEER_ROUTERS["vllm-kv_aware"], fleet.engines, model=name,
                                     block_size=16, log_dir=fleet.logs_dir)
    ...  # requests to router.url
    await router.stop()
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import aiohttp

from kvmesh.core.net import free_ports
from kvmesh.errors import FleetError
from kvmesh.fleet.config import HOST, EngineHandle
from kvmesh.fleet.process import ManagedProcess, probe_json, wait_until
from kvmesh.fleet.vllm import repo_root

PeerKind = Literal["sglang", "vllm"]
SGLANG_ROUTER_VERSION = "0.3.2"
VLLM_ROUTER_VERSION = "0.1.17"
PEER_EVENTS_TOPIC = ""
"""The topic vllm-router's static event sources subscribe to (vLLM's default topic)."""
_VENV_ENV = {"sglang": "KVMESH_SGLANG_ROUTER_VENV", "vllm": "KVMESH_VLLM_ROUTER_VENV"}
_VENV_DIR = {"sglang": ".venv-sglang-router", "vllm": ".venv-vllm-router"}
_CONSOLE_SCRIPT = {"sglang": "sglang-router", "vllm": "vllm-router"}
"""Installed with the package; scripts/install-peers.sh checks for the same file."""
_PACKAGE = {
    "sglang": f"sglang-router=={SGLANG_ROUTER_VERSION}",
    "vllm": f"vllm-router=={VLLM_ROUTER_VERSION}",
}


@dataclass(frozen=True, slots=True)
class PeerRouterSpec:
    """One peer router configuration.

    Attributes:
        name: key in :data:`PEER_ROUTERS` (``vllm-kv_aware``).
        kind: which peer.
        policy: its ``--policy``.
        static_event_sources: pass every engine's event and replay endpoints as
            ``--kv-event-source`` / ``--kv-event-replay-source`` (vllm-router ``kv_aware``).
    """

    name: str
    kind: PeerKind
    policy: str
    static_event_sources: bool = False

    @property
    def label(self) -> str:
        return f"{self.kind}-router {self.policy}"


PEER_ROUTERS: dict[str, PeerRouterSpec] = {
    spec.name: spec
    for spec in (
        PeerRouterSpec("sglang-cache_aware", "sglang", "cache_aware"),
        PeerRouterSpec("vllm-cache_aware", "vllm", "cache_aware"),
        PeerRouterSpec("vllm-kv_aware", "vllm", "kv_aware", static_event_sources=True),
    )
}
"""The peer configurations compared with kvmesh's router."""


def peer_venv(kind: PeerKind) -> Path:
    """The virtualenv ``kind``'s router runs from (it may not exist)."""
    env = os.environ.get(_VENV_ENV[kind])
    return Path(env) if env else repo_root() / _VENV_DIR[kind]


def peer_unavailable_reason(kind: PeerKind) -> str | None:
    """Why ``kind``'s router cannot be started here, or ``None`` when it can."""
    venv = peer_venv(kind)
    if not (venv / "bin" / _CONSOLE_SCRIPT[kind]).is_file():
        return (
            f"{_PACKAGE[kind]} is not installed in {venv}; run scripts/install-peers.sh "
            f"(or set ${_VENV_ENV[kind]})"
        )
    return None


def peer_router_argv(
    spec: PeerRouterSpec,
    engines: Sequence[EngineHandle],
    *,
    port: int,
    metrics_port: int,
    model: str,
    block_size: int,
) -> list[str]:
    """The command line of ``spec`` in front of ``engines``.

    Raises:
        ValueError: ``spec`` needs event endpoints an engine does not publish.
    """
    urls = [e.url for e in engines]
    common = ["--host", HOST, "--port", str(port), "--worker-urls", *urls, "--policy", spec.policy,
              "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
              "--worker-startup-check-interval", "1"]  # fmt: skip
    venv = peer_venv(spec.kind)
    if spec.kind == "sglang":
        python = str(venv / "bin" / "python")
        return [python, "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    argv = [str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"]
    if spec.static_event_sources:
        for engine in engines:
            if engine.events_endpoint is None:
                raise ValueError(f"{spec.name} needs KV events, engine {engine.url} publishes none")
            argv += ["--kv-event-source", f"{engine.url}={engine.events_endpoint}"]
            if engine.replay_endpoint is not None:
                argv += ["--kv-event-replay-source", f"{engine.url}={engine.replay_endpoint}"]
        argv += ["--kv-event-model", model, "--kv-event-block-size", str(block_size)]
    return argv


def _workers_probe(
    kind: PeerKind, session: aiohttp.ClientSession, url: str, expected: set[str]
) -> Callable[[], Awaitable[bool]]:
    """True once the router lists every engine as its worker (healthy, for sglang-router)."""
    path = "/workers" if kind == "sglang" else "/list_workers"

    async def probe() -> bool:
        _, body = await probe_json(session, url + path)
        if not isinstance(body, dict):
            return False
        if kind == "sglang":
            workers = body.get("workers") or []
            listed = {w.get("url") for w in workers if isinstance(w, dict) and w.get("is_healthy")}
        else:
            listed = set(body.get("urls") or [])
        return expected <= listed

    return probe


@dataclass(slots=True)
class PeerRouter:
    """A running peer router: where clients send requests and where it publishes metrics."""

    spec: PeerRouterSpec
    process: ManagedProcess
    url: str
    metrics_url: str

    async def stop(self, grace_s: float = 10.0) -> None:
        await self.process.stop(grace_s)


async def start_peer_router(
    spec: PeerRouterSpec,
    engines: Sequence[EngineHandle],
    *,
    model: str,
    block_size: int,
    log_dir: Path,
    timeout_s: float = 120.0,
) -> PeerRouter:
    """Start ``spec`` in front of ``engines`` and wait until it has registered all of them.

    Raises:
        FleetError: the peer is not installed, exited, or did not register every engine in time.
    """
    reason = peer_unavailable_reason(spec.kind)
    if reason is not None:
        raise FleetError(reason)
    port, metrics_port = free_ports(2)
    argv = peer_router_argv(
        spec, engines, port=port, metrics_port=metrics_port, model=model, block_size=block_size
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    process = ManagedProcess(spec.name, argv, log_dir / f"{spec.name}.log", env)
    process.start()
    url = f"http://{HOST}:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            probe = _workers_probe(spec.kind, session, url, {e.url for e in engines})
            await wait_until(process, probe, timeout_s, f"every engine registered at {url}")
    except BaseException:
        await process.stop()
        raise
    return PeerRouter(spec, process, url, f"http://{HOST}:{metrics_port}/metrics")
