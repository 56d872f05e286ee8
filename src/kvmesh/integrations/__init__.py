"""Connectors that let other serving engines use the kvmesh store.

``vllm`` holds the vLLM (v1) KV connector; it is glue over engine-neutral parts: ``paged_kv``
(paged cache ↔ store arrays), ``request_tracker`` (what each request loads and saves),
``store_bridge`` (time-bounded synchronous calls into the store), ``paged_transfer``
(running load and save plans against one paged cache) and ``shared_events`` (SHARED KV events for
saves that landed in a shared store tier).

The names below need no torch and no vLLM; ``vllm`` (the connector), ``paged_kv`` and
``paged_transfer`` import torch and are imported from their modules.
"""

from kvmesh.integrations.connector_config import ConnectorSettings
from kvmesh.integrations.request_tracker import LoadSpec, RequestTracker, SaveSpec, num_loadable_tokens
from kvmesh.integrations.shared_events import PromptBlocks, SharedWriteAnnouncer, shared_stored_event
from kvmesh.integrations.store_bridge import BridgeStats, StoreBridge

__all__ = [
    "BridgeStats",
    "ConnectorSettings",
    "LoadSpec",
    "PromptBlocks",
    "RequestTracker",
    "SaveSpec",
    "SharedWriteAnnouncer",
    "StoreBridge",
    "num_loadable_tokens",
    "shared_stored_event",
]
