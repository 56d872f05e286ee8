"""``pools:`` in ``router.yaml``: several served models behind one gateway, one pool each.

::

    pools:
      - name: chat                      # /pools/chat/... serves this pool's admin API and metrics
        model: smollm2                  # the ``model`` clients send (the index namespace's model)
        aliases: [SmolLM2-135M]         # other names routed to this pool
        tokenizer: smollm2
        blockSize: 16
        policy: precise                 # or a full ``scheduler`` block
        namespace: "kvmesh:idx:chat:"   # Redis key prefix of this pool's index
        flowControl: {enabled: true}
        endpoints: [{url: "http://10.0.0.5:8000"}]
        discovery: [{service: chat-engines.default.svc.cluster.local, port: 8000}]

Every key but ``name`` and ``model`` falls back to the router's top-level value. A config without
``pools`` is one pool, made of its top-level keys, and runs as before.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvmesh.errors import ConfigError
from kvmesh.router.discovery import DnsDiscoveryConfig
from kvmesh.router.endpoints import EndpointConfig
from kvmesh.router.flow_control import FlowControlConfig


class PoolConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """One served model: its endpoints and how requests for it are routed."""

    name: str
    model: str
    """The model name clients send; also the model of the pool's block keys."""
    aliases: list[str] = msgspec.field(default_factory=list)
    """Other ``model`` values routed to this pool (LoRA adapters its endpoints list are routed here
    without being named)."""
    revision: str | None = None
    tokenizer: str | None = None
    block_size: int | None = None
    policy: str | None = None
    scheduler: dict[str, Any] | None = None
    namespace: str | None = None
    """Key prefix of this pool's entries in a Redis index (default: the index's ``keyPrefix``
    followed by ``<name>:``); an in-memory index is the pool's own."""
    flow_control: FlowControlConfig | None = None
    endpoints: list[EndpointConfig] = msgspec.field(default_factory=list)
    discovery: list[DnsDiscoveryConfig] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"pools[].name must be non-empty and without '/', got {self.name!r}")
        if not self.model:
            raise ConfigError(f"pool {self.name}: model must be non-empty")
        if self.block_size is not None and self.block_size <= 0:
            raise ConfigError(f"pool {self.name}: blockSize must be positive, got {self.block_size}")
        if not self.endpoints and not self.discovery:
            raise ConfigError(f"pool {self.name}: needs endpoints or discovery")

    @property
    def served_names(self) -> list[str]:
        """The ``model`` values this pool answers: its model, then its aliases."""
        return [self.model, *self.aliases]


def check_pools(pools: list[PoolConfig], *, has_top_level_endpoints: bool) -> None:
    """Validate the pools of one router config.

    Raises:
        ConfigError: top-level endpoints beside pools, or a pool name or model named twice.
    """
    if not pools:
        return
    if has_top_level_endpoints:
        raise ConfigError("with pools, endpoints and discovery belong to each pool, not the top level")
    names: set[str] = set()
    models: dict[str, str] = {}
    for pool in pools:
        if pool.name in names:
            raise ConfigError(f"pool name {pool.name!r} is used twice")
        names.add(pool.name)
        for model in pool.served_names:
            if model in models:
                raise ConfigError(f"model {model!r} is served by pools {models[model]!r} and {pool.name!r}")
            models[model] = pool.name
