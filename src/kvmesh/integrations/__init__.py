"""Connectors that let other serving engines use the kvmesh store.

``vllm`` holds the vLLM (v1) KV connector; it is glue over engine-neutral parts: ``paged_kv``
(paged cache ↔ store arrays), ``request_tracker`` (what each request loads and saves),
``store_bridge`` (time-bounded synchronous calls into the store) and ``paged_transfer``
(running load and save plans against one paged cache).

The names below need no torch and no vLLM; ``vllm`` (the connector), ``paged_kv`` and
``paged_transfer`` import torch and are imported from their modules.
"""

from kvmesh.integrations.connector_config import ConnectorSettings
from kvmesh.integrations.request_tracker import LoadSpec, RequestTracker, SaveSpec, num_loadable_tokens
from kvmesh.integrations.store_bridge import BridgeStats, StoreBridge

__all__ = [
    "BridgeStats",
    "ConnectorSettings",
    "LoadSpec",
    "RequestTracker",
    "SaveSpec",
    "StoreBridge",
    "num_loadable_tokens",
]
