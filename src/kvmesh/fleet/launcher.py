# Over 450 lines: one Fleet owns every process it starts, restarts and stops (in reverse order); its settings live in fleet/config.py.
"""A fleet on one machine: N engines, the router, and the shared tier, as child processes.

::

    run_dir/
      fleet.json          URLs, ports, commands (written once everything is healthy)
      logs/engine-0.log   one log per process
      logs/router.log
      logs/redis.log      (--shared redis|valkey)
      shared/             the shared-directory tier (--shared dir, the default)

Used as a library (``async with Fleet(FleetConfig(...)) as fleet``) by ``kvmesh bench`` and the tests,
and from the command line as ``kvmesh up``. Every process runs in its own process group; leaving the
``async with`` block (normally, on error, or on cancellation) stops them all.

Engines are started with ``kvmesh engine`` and the router with ``kvmesh router`` of the same Python
interpreter, so the fleet always runs the code that launched it. With ``engine="vllm"`` the replicas
are real vLLM servers from ``.venv-vllm`` (:mod:`kvmesh.fleet.vllm`), loading and saving KV through
``KVMeshConnector`` when there is a shared tier, and the router reads their KV events and replay
sockets from a generated ``router.yaml`` (vLLM has no ``/kvmesh/info`` to discover them from).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import aiohttp

from kvmesh.core.net import free_port, free_ports
from kvmesh.errors import FleetError
from kvmesh.fleet.config import (
    HOST,
    SHARED_TIER_MAXMEMORY,
    VLLM_HEALTH_TIMEOUT_S,
    EngineHandle,
    FleetConfig,
    python_env,
    redis_server_binary,
)
from kvmesh.fleet.process import (
    ManagedProcess,
    all_healthy_probe,
    http_probe,
    tcp_probe,
    wait_until,
)
from kvmesh.fleet.vllm import VllmReplica, vllm_unavailable_reason
from kvmesh.store.local_server import server_argv


class Fleet:
    """Start, query, reconfigure and stop a local fleet. See the module docstring."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self._own_run_dir = config.run_dir is None
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="kvmesh-fleet-"))
        self.engines: list[EngineHandle] = []
        self.vllm_replicas: list[VllmReplica] = []
        """The running vLLM servers' settings (``engine="vllm"`` only)."""
        self.router: ManagedProcess | None = None
        self.router_url: str | None = None
        self.router_policy: str | None = None
        self.store_url: str | None = None
        self._store_proc: ManagedProcess | None = None
        self._session: aiohttp.ClientSession | None = None
        self._env = python_env(config.env)
        self._router_port: int | None = config.router_port

    # --- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Fleet:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def url(self) -> str:
        """Where clients send requests: the router, or the only engine when there is no router."""
        if self.router_url is not None:
            return self.router_url
        return self.engines[0].url

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def start(self) -> None:
        """Start the shared tier, the engines and the router, each waited for until healthy.

        Raises:
            FleetError: a process exited or did not become healthy (the message has its log tail).
        """
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        await self._start_shared_tier()
        await self.start_engines()
        if self.config.start_router:
            await self.start_router(self.config.policy)
        self._write_manifest(time.monotonic() - t0)

    async def aclose(self) -> None:
        """Stop every process (router first, then engines, then the shared tier)."""
        procs: list[ManagedProcess] = []
        if self.router is not None:
            procs.append(self.router)
        procs.extend(e.process for e in self.engines)
        await asyncio.gather(*(p.stop(self.config.stop_grace_s) for p in procs), return_exceptions=True)
        if self._store_proc is not None:
            await self._store_proc.stop(self.config.stop_grace_s)
        self.router = None
        self.router_url = None
        self.engines = []
        self._store_proc = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def kill_now(self) -> None:
        """SIGKILL every process group at once (for exit paths that cannot await)."""
        for p in self._processes():
            p.stop_now()

    # --- shared tier -----------------------------------------------------------------------------

    async def _start_shared_tier(self) -> None:
        kind = self.config.shared
        if kind == "none":
            self.store_url = None
        elif kind == "dir":
            shared = self.run_dir / "shared"
            shared.mkdir(parents=True, exist_ok=True)
            self.store_url = shared.resolve().as_uri()
        else:
            binary = redis_server_binary(kind)
            port = free_port()
            data_dir = self.run_dir / kind
            data_dir.mkdir(parents=True, exist_ok=True)
            argv = server_argv(binary, port, data_dir, maxmemory_bytes=SHARED_TIER_MAXMEMORY)
            proc = ManagedProcess(kind, argv, self.logs_dir / f"{kind}.log")
            proc.start()
            self._store_proc = proc
            await wait_until(proc, tcp_probe(HOST, port), 30, f"TCP {port}")
            self.store_url = f"{kind}://{HOST}:{port}"

    @property
    def store_process(self) -> ManagedProcess | None:
        """The redis-server or valkey-server of ``shared="redis"|"valkey"`` (``None`` otherwise)."""
        return self._store_proc

    async def restart_shared_tier(self) -> None:
        """Start the shared server again on its port (after it died or was killed); the new one is
        empty. A no-op for the directory tier and for none."""
        old = self._store_proc
        if old is None:
            return
        await old.stop(self.config.stop_grace_s)
        proc = ManagedProcess(old.name, old.argv, old.log_path)
        proc.start()
        self._store_proc = proc
        port = int(old.argv[old.argv.index("--port") + 1])
        await wait_until(proc, tcp_probe(HOST, port), 30, f"TCP {port}")

    async def reset_shared_tier(self) -> None:
        """Empty the shared tier (delete the directory's contents, or FLUSHALL the server)."""
        if self.config.shared == "dir" and self.store_url is not None:
            shared = self.run_dir / "shared"
            for child in shared.iterdir():
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
        elif self.config.shared in ("redis", "valkey") and self.store_url is not None:
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(self.store_url.replace("valkey://", "redis://"))
            try:
                await client.flushall()
            finally:
                await client.aclose()

    # --- engines ---------------------------------------------------------------------------------

    def _engine_argv(self, port: int, events_port: int | None) -> list[str]:
        cfg = self.config
        argv = [
            sys.executable,
            "-m",
            "kvmesh",
            "engine",
            "--model",
            cfg.model,
            "--host",
            HOST,
            "--port",
            str(port),
        ]
        if cfg.emulate:
            argv += ["--emulate", cfg.emulate]
        if events_port is not None:
            argv += ["--events", f"tcp://{HOST}:{events_port}"]
        if self.store_url is not None and (not cfg.emulate or cfg.emulated_store):
            argv += ["--store", self.store_url]
        return argv + list(cfg.engine_args)

    def _vllm_replicas(self) -> list[VllmReplica]:
        from kvmesh.core.models import resolve_model

        reason = vllm_unavailable_reason()
        if reason is not None:
            raise FleetError(f"engine vllm: {reason}")
        model_dir = resolve_model(self.config.model).path
        n = self.config.num_engines
        ports = free_ports(3 * n)
        cores = os.cpu_count() or 1
        return [
            VllmReplica(
                name=f"engine-{i}",
                port=ports[3 * i],
                events_port=ports[3 * i + 1] if self.config.events else 0,
                replay_port=ports[3 * i + 2] if self.config.events else 0,
                model_dir=model_dir,
                store=self.store_url,
                cpu_core=i % cores,
                dev_mode=True,
                extra_args=tuple(self.config.engine_args),
            )
            for i in range(n)
        ]

    def _start_vllm_engines(self) -> None:
        self.vllm_replicas = self._vllm_replicas()
        for i, replica in enumerate(self.vllm_replicas):
            proc = ManagedProcess(
                replica.name, replica.argv(), self.logs_dir / f"{replica.name}.log", replica.env(self._env)
            )
            proc.start()
            self.engines.append(
                EngineHandle(
                    index=i,
                    url=replica.url,
                    port=replica.port,
                    events_endpoint=replica.events_endpoint,
                    process=proc,
                    replay_endpoint=replica.replay_endpoint,
                )
            )

    async def start_engines(self) -> None:
        """Start ``num_engines`` engines (any running ones are stopped first) and wait for /health."""
        if self.engines:
            await self.stop_engines()
        if self.config.engine == "vllm":
            self._start_vllm_engines()
            await self._wait_engines_healthy(max(self.config.health_timeout_s, VLLM_HEALTH_TIMEOUT_S))
            return
        n = self.config.num_engines
        ports = free_ports(2 * n if self.config.events else n)
        for i in range(n):
            port = ports[i]
            events_port = ports[n + i] if self.config.events else None
            proc = ManagedProcess(
                f"engine-{i}",
                self._engine_argv(port, events_port),
                self.logs_dir / f"engine-{i}.log",
                self._env,
            )
            proc.start()
            self.engines.append(
                EngineHandle(
                    index=i,
                    url=f"http://{HOST}:{port}",
                    port=port,
                    events_endpoint=f"tcp://{HOST}:{events_port}" if events_port is not None else None,
                    process=proc,
                )
            )
        await self._wait_engines_healthy(self.config.health_timeout_s)

    async def _wait_engines_healthy(self, timeout_s: float) -> None:
        session = self._http()
        await asyncio.gather(
            *(
                wait_until(e.process, http_probe(session, e.url + "/health"), timeout_s, "/health")
                for e in self.engines
            )
        )

    async def restart_engine(self, index: int) -> None:
        """Start engine ``index`` again with its command (same HTTP and event ports) after it died
        or was killed, and wait for /health. Its device-tier cache starts empty and its event
        sequence restarts at 0, so the router sees a publisher restart.

        Raises:
            ValueError: no such engine, or a vLLM fleet.
        """
        if self.config.engine != "kvmesh" or not 0 <= index < len(self.engines):
            raise ValueError(f"restart_engine({index}): {len(self.engines)} kvmesh engines running")
        handle = self.engines[index]
        old = handle.process
        await old.stop(self.config.stop_grace_s)
        proc = ManagedProcess(old.name, old.argv, old.log_path, old.env)
        proc.start()
        handle.process = proc
        await wait_until(
            proc, http_probe(self._http(), handle.url + "/health"), self.config.health_timeout_s, "/health"
        )

    async def stop_engines(self) -> None:
        await asyncio.gather(*(e.process.stop(self.config.stop_grace_s) for e in self.engines))
        self.engines = []

    async def reset_engine_caches(self) -> bool:
        """Empty every engine's device-tier cache through ``POST /reset_prefix_cache`` (vLLM's admin
        route); returns ``False`` when an engine lacks the route or refuses (requests in flight)."""
        session = self._http()

        async def one(url: str) -> bool:
            try:
                async with session.post(
                    url + "/reset_prefix_cache", timeout=aiohttp.ClientTimeout(total=10)
                ) as resp:
                    return resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                return False

        return all(await asyncio.gather(*(one(e.url) for e in self.engines)))

    async def restart_engines(self) -> None:
        """Restart every engine on fresh ports: empties their device-tier caches and restarts their
        event sequences. The router, if running, is restarted too so it targets the new ports."""
        policy = self.router_policy
        had_router = self.router is not None
        if had_router:
            await self.stop_router()
        await self.start_engines()
        if had_router and policy is not None:
            await self.start_router(policy)

    # --- router ----------------------------------------------------------------------------------

    def _vllm_router_config(self) -> Path:
        """A router YAML naming each vLLM replica's event and replay sockets (JSON is YAML)."""
        from kvmesh.core.models import resolve_model

        config = {
            "model": "smollm2",
            "tokenizer": str(resolve_model(self.config.model).path),
            "endpoints": [
                {"url": e.url, "eventsEndpoint": e.events_endpoint, "replayEndpoint": e.replay_endpoint}
                for e in self.engines
            ],
        }
        path = self.run_dir / "router.yaml"
        path.write_text(json.dumps(config, indent=2))
        return path

    def _router_argv(self, port: int, policy: str, scheduler_config: str | None) -> list[str]:
        argv = [sys.executable, "-m", "kvmesh", "router", "--host", HOST, "--port", str(port)]
        if self.config.engine == "vllm":
            argv += ["--config", str(self._vllm_router_config()), "--policy", policy]
        elif self.config.router_config:
            argv += ["--endpoints", ",".join(self.engine_urls), "--config", self.config.router_config]
        else:
            argv += ["--endpoints", ",".join(self.engine_urls), "--policy", policy]
            if "--tokenizer" not in self.config.router_args:
                # the engines' own tokenizer, so text and chat prompts are routed by their prefix too
                argv += ["--tokenizer", self.config.model]
        if scheduler_config:
            argv += ["--scheduler-config", scheduler_config]
        return argv + list(self.config.router_args)

    async def start_router(self, policy: str, scheduler_config: str | None = None) -> None:
        """Start the router in front of the current engines and wait for /health.

        Args:
            policy: the router's ``--policy`` preset (also the label of this router).
            scheduler_config: a scheduler YAML that replaces the preset's plugins and weights.
        """
        if self.router is not None:
            await self.stop_router()
        if self._router_port is None:
            self._router_port = free_port()
        port = self._router_port
        argv = self._router_argv(port, policy, scheduler_config)
        proc = ManagedProcess("router", argv, self.logs_dir / "router.log", self._env)
        proc.start()
        self.router = proc
        url = f"http://{HOST}:{port}"
        # the router answers 200 once one engine is healthy; wait until it sees all of them
        probe = all_healthy_probe(self._http(), url + "/health")
        await wait_until(proc, probe, self.config.health_timeout_s, "/health: every endpoint healthy")
        self.router_url = url
        self.router_policy = policy

    async def stop_router(self) -> None:
        if self.router is not None:
            await self.router.stop(self.config.stop_grace_s)
        self.router = None
        self.router_url = None

    # --- state -----------------------------------------------------------------------------------

    def check_alive(self) -> None:
        """Raise :class:`FleetError` if any process of the fleet has exited."""
        for p in self._processes():
            p.check_alive()

    def _processes(self) -> list[ManagedProcess]:
        """The fleet's running processes: router, engines, shared tier."""
        every = [self.router, *(e.process for e in self.engines), self._store_proc]
        return [p for p in every if p is not None]

    def manifest(self) -> dict[str, object]:
        return {
            "run_dir": str(self.run_dir),
            "router_url": self.router_url,
            "router_policy": self.router_policy,
            "store_url": self.store_url,
            "engines": [
                {
                    "url": e.url,
                    "events": e.events_endpoint,
                    "replay": e.replay_endpoint,
                    "pid": e.process.pid,
                    "log": str(e.process.log_path),
                }
                for e in self.engines
            ],
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.config).items()},
        }

    def _write_manifest(self, startup_s: float) -> None:
        data = self.manifest()
        data["startup_s"] = round(startup_s, 2)
        with contextlib.suppress(OSError):
            (self.run_dir / "fleet.json").write_text(json.dumps(data, indent=2))


async def launch(config: FleetConfig) -> Fleet:
    """Start a fleet and return it (the caller must ``await fleet.aclose()``)."""
    fleet = Fleet(config)
    try:
        await fleet.start()
    except BaseException:
        await fleet.aclose()
        raise
    return fleet
