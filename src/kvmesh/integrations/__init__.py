"""Connectors that let other serving engines use the kvmesh store.

``vllm`` holds the vLLM (v1) KV connector only; it is glue over engine-neutral parts: ``paged_kv``
(paged cache ↔ store arrays), ``request_tracker`` (what each request loads and saves),
``store_bridge`` (time-bounded synchronous calls into the store) shared per process through
``bridge_pool``, ``paged_transfer`` (running load and save plans against one paged cache),
``vllm_format`` (the KV format and layout read from vLLM's config) and ``vllm_compat`` (vLLM's base
classes, or the least that stands for them without vLLM). SHARED KV events for saves that landed in
a shared store tier come from :mod:`kvmesh.core.shared_writes`, the announcer kvmesh's engine uses too.

The names below need no torch and no vLLM; ``vllm`` (the connector), ``vllm_format``, ``paged_kv``
and ``paged_transfer`` import torch and are imported from their modules.
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
