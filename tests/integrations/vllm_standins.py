"""Stand-ins for the vLLM objects the connector is handed (its role, config and requests), for
driving :class:`~kvmesh.integrations.vllm.KVMeshConnector` through vLLM's calls without vLLM."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

BS = 16


class ConnectorRole(enum.Enum):
    """vLLM's ``KVConnectorRole`` (the connector does not depend on it: each side uses only its
    own methods)."""

    SCHEDULER = 0
    WORKER = 1


def make_vllm_config(
    extra: dict[str, Any],
    *,
    cache_dtype: str = "auto",
    tp: int = 1,
    pp: int = 1,
    use_mla: bool = False,
    kv_events: bool = False,
) -> SimpleNamespace:
    model_config = SimpleNamespace(
        model="org/model",
        served_model_name="org/model",
        revision=None,
        dtype=torch.bfloat16,
        use_mla=use_mla,
        get_num_layers=lambda pc: 3,
        get_num_kv_heads=lambda pc: 2,
        get_head_size=lambda: 8,
    )
    return SimpleNamespace(
        model_config=model_config,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        cache_config=SimpleNamespace(block_size=BS, cache_dtype=cache_dtype),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        kv_events_config=SimpleNamespace(enable_kv_cache_events=kv_events),
    )


def make_request(req_id: str, prompt: Sequence[int], **kw: Any) -> SimpleNamespace:
    fields: dict[str, Any] = {"lora_request": None, "cache_salt": None, "mm_features": []}
    fields.update(kw)
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(prompt), **fields)
