"""Settings of the vLLM connector, read from ``kv_connector_extra_config``.

::

    --kv-transfer-config '{"kv_connector": "KVMeshConnector",
                           "kv_connector_module_path": "kvmesh.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "valkey://cache:6379/0"}}'

| key | default | meaning |
|---|---|---|
| ``store`` | ``$KVMESH_STORE_CONFIG``, else a RAM tier | URL shorthand or YAML path for the store |
| ``lookup_timeout_s`` | 0.05 | longest wait for lookups in one scheduler step, shared by the step's lookups (then vLLM steps on and asks again) |
| ``lookup_deadline_s`` | 5.0 | longest time a request waits for its lookup across steps (then: miss) |
| ``retrieve_timeout_s`` | 2.0 | longest worker wait for a load (then: recompute) |
| ``max_inflight`` | 64 | store calls outstanding per process (then: miss / dropped save) |
| ``save`` | true | save computed prompt chunks (false: load only) |
| ``model`` | vLLM's model name | model id in store keys (set it when replicas name the model differently) |
| ``revision`` | vLLM's revision | revision in store keys |
| ``tenant`` | "" | tenant salt for requests without a ``cache_salt`` |
| ``announce_shared_writes`` | true | publish a ``"SHARED"`` ``BlockStored`` through vLLM's KV events when a save lands in a shared tier |
| ``async_load_min_mib`` | 64 | loads of at least this much KV run in the background (vLLM steps other requests meanwhile); smaller ones run in the step, which saves the request a step's wait |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.errors import ConfigError

_KEYS = frozenset(
    {
        "store",
        "lookup_timeout_s",
        "lookup_deadline_s",
        "retrieve_timeout_s",
        "max_inflight",
        "save",
        "model",
        "revision",
        "tenant",
        "announce_shared_writes",
        "async_load_min_mib",
    }
)


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """Parsed ``kv_connector_extra_config`` (see the module docstring for each key)."""

    store: str | None = None
    lookup_timeout_s: float = 0.05
    lookup_deadline_s: float = 5.0
    retrieve_timeout_s: float = 2.0
    max_inflight: int = 64
    save: bool = True
    model: str | None = None
    revision: str | None = None
    tenant: str = ""
    announce_shared_writes: bool = True
    async_load_min_mib: float = 64.0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Parse the connector's extra config; unknown keys and wrong types are errors.

        Keys may carry a ``kvmesh.`` prefix (``"kvmesh.store"``), so the dictionary can be shared
        with other connectors.

        Raises:
            ConfigError: an unknown key or a value of the wrong type or range.
        """
        values: dict[str, Any] = {}
        for raw_key, value in (extra or {}).items():
            key = raw_key.removeprefix("kvmesh.")
            if key not in _KEYS:
                if raw_key.startswith("kvmesh."):
                    raise ConfigError(f"unknown kvmesh connector setting {raw_key!r}; known: {sorted(_KEYS)}")
                continue
            values[key] = value
        store = values.get("store", os.environ.get("KVMESH_STORE_CONFIG") or None)
        settings = cls(
            store=_opt_str("store", store),
            lookup_timeout_s=_positive_float("lookup_timeout_s", values.get("lookup_timeout_s", 0.05)),
            lookup_deadline_s=_positive_float("lookup_deadline_s", values.get("lookup_deadline_s", 5.0)),
            retrieve_timeout_s=_positive_float("retrieve_timeout_s", values.get("retrieve_timeout_s", 2.0)),
            max_inflight=_positive_int("max_inflight", values.get("max_inflight", 64)),
            save=_bool("save", values.get("save", True)),
            model=_opt_str("model", values.get("model")),
            revision=_opt_str("revision", values.get("revision")),
            tenant=_opt_str("tenant", values.get("tenant")) or "",
            announce_shared_writes=_bool(
                "announce_shared_writes", values.get("announce_shared_writes", True)
            ),
            async_load_min_mib=_non_negative_float(
                "async_load_min_mib", values.get("async_load_min_mib", 64.0)
            ),
        )
        return settings


def _opt_str(key: str, value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ConfigError(f"kvmesh connector setting {key!r} must be a string, got {value!r}")


def _positive_float(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"kvmesh connector setting {key!r} must be a positive number, got {value!r}")
    return float(value)


def _non_negative_float(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(f"kvmesh connector setting {key!r} must be a number >= 0, got {value!r}")
    return float(value)


def _positive_int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"kvmesh connector setting {key!r} must be a positive integer, got {value!r}")
    return value


def _bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in {"true", "false", "1", "0"}:
        return value.lower() in {"true", "1"}
    raise ConfigError(f"kvmesh connector setting {key!r} must be true or false, got {value!r}")
