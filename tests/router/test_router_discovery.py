"""DNS discovery: engines join and leave the pool as a name's addresses change (a headless Service)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from router_fakes import FakeEngine

from kvmesh.errors import ConfigError
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.discovery import DnsDiscovery, DnsDiscoveryConfig, resolve_addresses
from kvmesh.router.endpoints import EndpointConfig, EndpointPool
from kvmesh.router.gateway import Gateway

HOSTS = ("127.0.0.2", "127.0.0.3")
"""Two loopback addresses: pods of one Service listen on the same port at different IPs."""


def _port_free_on_all() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind((HOSTS[0], 0))
            port = int(s.getsockname()[1])
        try:
            with socket.socket() as s:
                s.bind((HOSTS[1], port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on both loopback addresses")


class ScriptedDns:
    """A resolver whose answer the test sets; ``None`` fails the look-up."""

    def __init__(self) -> None:
        self.answer: list[str] | None = []
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        if self.answer is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.answer)


@pytest.fixture
async def pods():
    port = _port_free_on_all()
    engines = [await FakeEngine(f"pod{i}").start(port, host) for i, host in enumerate(HOSTS)]
    yield port, engines
    for e in engines:
        await e.stop()


async def test_pool_follows_the_names_addresses(pods):
    port, engines = pods
    dns = ScriptedDns()
    async with aiohttp.ClientSession() as session:
        pool = EndpointPool(session, metrics_interval=0)
        static = await FakeEngine("static").start()
        await pool.add(EndpointConfig(url=static.url))
        discovery = DnsDiscovery(pool, [DnsDiscoveryConfig(service="engines.test", port=port)], dns)
        try:
            dns.answer = [HOSTS[0]]
            await discovery.refresh()
            assert {e.state.pod for e in pool.endpoints} == {static.url, engines[0].url}
            joined = pool.get(engines[0].url)
            assert joined is not None and joined.state.healthy
            # kvmesh engines name their events endpoint in /kvmesh/info
            assert joined.events_endpoint is not None and joined.events_endpoint.startswith("tcp://")

            dns.answer = list(HOSTS)
            await discovery.refresh()
            assert discovery.discovered() == {engines[0].url, engines[1].url}

            pool.remove(engines[0].url)  # dropped by hand while DNS still names it: joins again
            await discovery.refresh()
            assert engines[0].url in pool

            dns.answer = None  # resolver down: nothing changes
            await discovery.refresh()
            assert discovery.num_lookup_failures == 1
            assert len(pool.endpoints) == 3

            dns.answer = [HOSTS[1]]  # pod 0 went away; the static endpoint is not discovery's to drop
            await discovery.refresh()
            assert {e.state.pod for e in pool.endpoints} == {static.url, engines[1].url}
            assert len(pool.states()) == 2
        finally:
            await discovery.aclose()
            await static.stop()


async def test_fixed_event_ports_for_vllm_pods(pods):
    port, engines = pods
    for e in engines:
        e.vllm_like = True
    dns = ScriptedDns()
    dns.answer = list(HOSTS)
    config = DnsDiscoveryConfig(
        service="vllm.test", port=port, events_port=5557, replay_port=5558, role="decode"
    )
    async with aiohttp.ClientSession() as session:
        pool = EndpointPool(session, metrics_interval=0)
        discovery = DnsDiscovery(pool, [config], dns)
        await discovery.refresh()
        endpoint = pool.get(engines[1].url)
        assert endpoint is not None
        assert endpoint.events_endpoint == f"tcp://{HOSTS[1]}:5557"
        assert endpoint.replay_endpoint == f"tcp://{HOSTS[1]}:5558"
        assert endpoint.state.role.value == "decode"


async def test_gateway_routes_to_discovered_engines(pods):
    port, engines = pods
    config = router_config_from_dict(
        {
            "model": "test-model",
            "policy": "load",
            "discovery": [{"service": "localhost", "port": port, "intervalS": 0.2}],
            "health": {"metricsIntervalS": 0},
        }
    )
    gateway = Gateway(config)
    dns = ScriptedDns()
    dns.answer = list(HOSTS)
    await gateway.start()
    try:
        assert gateway.discovery is not None
        # "localhost" resolved for real: 127.0.0.1, where no engine listens on this port
        assert gateway.pool is not None and len(gateway.pool.endpoints) >= 1
        gateway.discovery.resolver = dns  # the background loop (every 0.2 s) picks the pods up
        for _ in range(50):
            if dns.calls >= 2:
                break
            await asyncio.sleep(0.1)
        pods_now = {e.state.pod for e in gateway.pool.endpoints}
        assert {engines[0].url, engines[1].url} <= pods_now
        assert f"http://127.0.0.1:{port}" not in pods_now
    finally:
        await gateway.aclose()


async def test_real_lookup_of_localhost():
    addresses = await resolve_addresses("localhost", 80)
    assert "127.0.0.1" in addresses or "::1" in addresses
    assert addresses == sorted(set(addresses))
    with pytest.raises(OSError):
        await resolve_addresses("no-such-host.invalid", 80)


def test_ipv6_addresses_are_bracketed():
    ep = DnsDiscoveryConfig(service="x", port=8000, events_port=5557).endpoint_for("fd00::5")
    assert ep.url == "http://[fd00::5]:8000"
    assert ep.events_endpoint == "tcp://[fd00::5]:5557"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"service": ""}, "DNS name"),
        ({"service": "x", "port": 0}, "port must be"),
        ({"service": "x", "eventsPort": 70000}, "eventsPort must be"),
        ({"service": "x", "scheme": "ftp"}, "scheme"),
        ({"service": "x", "intervalS": 0}, "intervalS"),
        ({"service": "x", "replayPort": 5558}, "replayPort needs eventsPort"),
    ],
)
def test_bad_discovery_config_is_a_clear_error(fields, message):
    with pytest.raises(ConfigError, match=message):
        router_config_from_dict({"discovery": [fields]})
