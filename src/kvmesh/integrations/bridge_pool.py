"""Store bridges shared by the connectors of one process."""

from __future__ import annotations

import threading

from kvmesh.integrations.connector_config import ConnectorSettings
from kvmesh.integrations.store_bridge import StoreBridge


class BridgePool:
    """One store bridge per configuration per process, shared by the scheduler's and the
    workers' connectors when they live in one process (their RAM tier is then one tier)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bridges: dict[tuple[object, ...], tuple[StoreBridge, int]] = {}

    def acquire(self, settings: ConnectorSettings) -> StoreBridge:
        key = (settings.store, settings.lookup_timeout_s, settings.retrieve_timeout_s, settings.max_inflight)
        with self._lock:
            entry = self._bridges.get(key)
            if entry is None:
                bridge = StoreBridge(
                    settings.store,
                    lookup_timeout_s=settings.lookup_timeout_s,
                    retrieve_timeout_s=settings.retrieve_timeout_s,
                    max_inflight=settings.max_inflight,
                )
                self._bridges[key] = (bridge, 1)
                return bridge
            self._bridges[key] = (entry[0], entry[1] + 1)
            return entry[0]

    def release(self, bridge: StoreBridge) -> None:
        with self._lock:
            for key, (held, count) in self._bridges.items():
                if held is bridge:
                    if count > 1:
                        self._bridges[key] = (held, count - 1)
                        return
                    del self._bridges[key]
                    break
            else:
                return
        bridge.close()


BRIDGES = BridgePool()
"""The process's pool: vLLM builds each connector itself, so they can only meet here."""
