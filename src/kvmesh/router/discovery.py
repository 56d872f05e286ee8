"""Endpoints found in DNS: one name that resolves to every engine pod (a Kubernetes headless Service).

A headless Service (``clusterIP: None``) answers its DNS name with the IP of every ready pod behind
it. Each ``discovery:`` entry of the router config names one such service; every ``intervalS`` the
router resolves it and brings the pool in line:

* a new address joins as ``http://<ip>:<port>``, with its events at ``tcp://<ip>:<eventsPort>``
  (vLLM pods, whose ``--kv-events-config`` port is fixed per deployment) or, without ``eventsPort``,
  from the engine's own ``/kvmesh/info`` (kvmesh engines);
* an address that stopped resolving leaves the pool, and the index forgets its blocks;
* a failed look-up (the DNS server unreachable, or no ready pod at all, where a headless Service
  answers NXDOMAIN) changes nothing: health checks already take dead pods out, and a resolver
  hiccup must not empty the fleet.

Only endpoints a discovery entry added are ever removed by it; endpoints from ``endpoints:`` or the
admin API stay.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

import msgspec

from kvmesh.core.tasks import cancel_and_wait
from kvmesh.core.types import PodId
from kvmesh.errors import ConfigError
from kvmesh.router.endpoints import EndpointConfig, EndpointPool, normalize_url

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``(host, port) -> addresses``; raises ``OSError`` when the look-up fails."""


class DnsDiscoveryConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """One DNS name whose addresses are engine pods (YAML ``discovery:`` entries).

    Attributes:
        service: the name, e.g. ``vllm-engines.llm.svc.cluster.local``.
        port: the engines' HTTP port.
        scheme: ``http`` or ``https``.
        events_port: ZMQ PUB port of every pod's KV events; ``None`` asks each engine
            (``/kvmesh/info``), which only kvmesh engines answer.
        replay_port: ZMQ ROUTER port for event replay; ``None`` as ``events_port``.
        role: ``both``, ``prefill`` or ``decode`` for every pod of this name; ``None`` takes the
            engine's own.
        interval_s: seconds between look-ups.
    """

    service: str
    port: int = 8000
    scheme: str = "http"
    events_port: int | None = None
    replay_port: int | None = None
    role: str | None = None
    interval_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.service:
            raise ConfigError("discovery: service must name a DNS name")
        for name, port in (
            ("port", self.port),
            ("eventsPort", self.events_port),
            ("replayPort", self.replay_port),
        ):
            if port is not None and not 0 < port < 65536:
                raise ConfigError(f"discovery {self.service}: {name} must be in 1..65535, got {port}")
        if self.scheme not in ("http", "https"):
            raise ConfigError(f"discovery {self.service}: scheme must be http or https, got {self.scheme!r}")
        if self.interval_s <= 0:
            raise ConfigError(f"discovery {self.service}: intervalS must be positive, got {self.interval_s}")
        if self.replay_port is not None and self.events_port is None:
            raise ConfigError(f"discovery {self.service}: replayPort needs eventsPort")

    def endpoint_for(self, address: str) -> EndpointConfig:
        """The endpoint of the pod at ``address`` (an IPv4 or IPv6 literal)."""
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        return EndpointConfig(
            url=f"{self.scheme}://{host}:{self.port}",
            role=self.role,
            events_endpoint=f"tcp://{host}:{self.events_port}" if self.events_port else None,
            replay_endpoint=f"tcp://{host}:{self.replay_port}" if self.replay_port else None,
        )


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to for TCP, in a stable order, without duplicates."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class DnsDiscovery:
    """Keeps the pool's discovered endpoints equal to what the configured names resolve to.

    Args:
        pool: the router's endpoint pool.
        configs: the names to follow.
        resolver: the look-up (default: the event loop's ``getaddrinfo``).
    """

    def __init__(
        self, pool: EndpointPool, configs: list[DnsDiscoveryConfig], resolver: Resolver = resolve_addresses
    ) -> None:
        self.pool = pool
        self.configs = list(configs)
        self.resolver = resolver
        self._owned: list[set[PodId]] = [set() for _ in self.configs]
        self._tasks: list[asyncio.Task[None]] = []
        self.num_lookup_failures = 0

    def discovered(self) -> set[PodId]:
        """The endpoints this discovery added and still holds."""
        return set().union(*self._owned) if self._owned else set()

    async def refresh(self) -> None:
        """Resolve every name once and apply the differences."""
        for i in range(len(self.configs)):
            await self._refresh_one(i)

    async def _refresh_one(self, i: int) -> None:
        config = self.configs[i]
        try:
            addresses = await self.resolver(config.service, config.port)
        except OSError as exc:
            self.num_lookup_failures += 1
            logger.warning("discovery: cannot resolve %s (%s); keeping %d endpoints", config.service, exc,
                           len(self._owned[i]))  # fmt: skip
            return
        wanted = {normalize_url(config.endpoint_for(a).url): a for a in addresses}
        owned = self._owned[i]
        for pod in sorted(owned - wanted.keys()):
            logger.info("discovery: %s left %s", pod, config.service)
            self.pool.remove(pod)
            owned.discard(pod)
        for pod, address in sorted(wanted.items()):
            if pod in self.pool:  # already there: joined earlier, or configured or added by the admin API
                continue
            logger.info("discovery: %s joined %s", pod, config.service)
            await self.pool.add(config.endpoint_for(address))
            owned.add(pod)

    def start(self) -> None:
        """Follow every name in the background (one loop per name, at its own interval)."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow(i)) for i in range(len(self.configs))]

    async def _follow(self, i: int) -> None:
        interval = self.configs[i].interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self._refresh_one(i)
            except ConfigError as exc:
                logger.error("discovery: %s: %s", self.configs[i].service, exc)

    async def aclose(self) -> None:
        """Stop following."""
        await cancel_and_wait(self._tasks)
        self._tasks = []
