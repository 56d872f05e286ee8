"""What the connector reads of vLLM's config and attention backends: the KV format that enters store
keys, the paged layout vLLM declares, and the cache-hit label of the store's outermost tier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvmesh.core.torch_kv import store_dtype_name
from kvmesh.integrations.paged_kv import PagedLayout


@dataclass(frozen=True, slots=True)
class ModelKVFormat:
    """The per-worker KV format that enters store keys.

    Attributes:
        kv_dtype: "float32", "float16" or "bfloat16".
        num_layers: attention layers.
        num_kv_heads: KV heads per tensor-parallel rank.
        head_dim: values per head.
        tp_size: tensor-parallel size.
        tp_rank: this worker's rank (0 in the scheduler).
    """

    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0

    def layout_name(self) -> str:
        """Layout string for store namespaces (TP > 1 adds the size and rank: ranks hold different heads)."""
        base = f"L{self.num_layers}xH{self.num_kv_heads}xD{self.head_dim}"
        return base if self.tp_size == 1 else f"{base}-tp{self.tp_size}r{self.tp_rank}"

    def for_rank(self, tp_rank: int) -> ModelKVFormat:
        """This format as seen by tensor-parallel rank ``tp_rank``."""
        return ModelKVFormat(
            self.kv_dtype, self.num_layers, self.num_kv_heads, self.head_dim, self.tp_size, tp_rank
        )


def model_kv_format(vllm_config: Any) -> ModelKVFormat:
    """The KV format vLLM will use for ``vllm_config``'s model (rank 0).

    Raises:
        ValueError: a model or setting the connector does not handle (MLA, pipeline parallelism,
            a quantized KV cache).
    """
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    if getattr(model_config, "use_mla", False):
        raise ValueError("KVMeshConnector does not handle MLA models (latent KV cache)")
    if getattr(parallel_config, "pipeline_parallel_size", 1) != 1:
        raise ValueError("KVMeshConnector does not handle pipeline parallelism")
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype == "auto":
        dtype = model_config.dtype
    elif cache_dtype in {"float16", "half"}:
        dtype = torch.float16
    elif cache_dtype == "bfloat16":
        dtype = torch.bfloat16
    elif cache_dtype == "float32":
        dtype = torch.float32
    else:
        raise ValueError(f"KVMeshConnector needs a float16/bfloat16/float32 KV cache, got {cache_dtype!r}")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return ModelKVFormat(
        kv_dtype=store_dtype_name(dtype),
        num_layers=int(model_config.get_num_layers(parallel_config)),
        num_kv_heads=int(model_config.get_num_kv_heads(parallel_config)),
        head_dim=int(model_config.get_head_size()),
        tp_size=int(getattr(parallel_config, "tensor_parallel_size", 1)),
    )


_PROBE_BLOCKS = 7919
"""A block count no other axis of a probed cache shape can equal (prime, larger than any head count)."""


def _attention_backend(vllm_config: Any, layer_name: str) -> Any:
    """The attention backend class vLLM chose for ``layer_name`` (``None`` when not reachable)."""
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)
    layer = context.get(layer_name) if isinstance(context, dict) else None
    if layer is None:
        return None
    backend = getattr(layer, "attn_backend", None)
    if backend is None and hasattr(layer, "get_attn_backend"):
        backend = layer.get_attn_backend()
    return backend


def _backend_name(backend: Any) -> str:
    try:
        return str(backend.get_name())
    except Exception:  # any failure only costs the name in messages
        return getattr(backend, "__name__", "an unknown attention backend")


def declared_kv_layout(
    vllm_config: Any, layer_name: str, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[PagedLayout | None, str]:
    """The per-layer cache layout vLLM declares, and who declared it (for messages).

    vLLM 0.32 and later hand every attention backend a logical ``[B, H, N, C]`` view per layer
    (K then V in C; the physical order is the resolved ``KVCacheLayout``). Earlier versions give
    each backend's ``get_kv_cache_shape``, probed here with a block count no other axis can equal.

    Returns:
        ``(layout, source)``; ``layout`` is ``None`` when vLLM declares nothing readable (the
        shape then decides).

    Raises:
        ValueError: the backend declares a shape the connector cannot read.
    """
    backend = _attention_backend(vllm_config, layer_name)
    name = _backend_name(backend) if backend is not None else "vLLM"
    try:
        import vllm.v1.kv_cache_layout  # noqa: F401  (present since the [B, H, N, C] views)
    except ImportError:
        pass
    else:
        order = "unresolved"
        resolve = getattr(vllm_config.cache_config, "get_resolved_kv_cache_layout", None)
        if callable(resolve):
            try:
                order = resolve().name
            except ValueError:
                pass
        return PagedLayout.HEADS_KV_CONCAT, f"{name}, [B, H, N, C] view in {order} memory order"
    shape_of = getattr(backend, "get_kv_cache_shape", None)
    if shape_of is None:
        return None, name
    shape = tuple(shape_of(_PROBE_BLOCKS, block_size, num_kv_heads, head_dim))
    if len(shape) == 5 and shape[1] == _PROBE_BLOCKS and shape[0] == 2:
        return PagedLayout.KV_FIRST, f"{name}, get_kv_cache_shape {list(shape)}"
    if len(shape) == 5 and shape[0] == _PROBE_BLOCKS and shape[1] == 2:
        return PagedLayout.BLOCKS_FIRST, f"{name}, get_kv_cache_shape {list(shape)}"
    raise ValueError(
        f"KVMeshConnector cannot read the KV cache of attention backend {name}: it declares "
        f"get_kv_cache_shape(num_blocks, {block_size}, {num_kv_heads}, {head_dim}) = {list(shape)} "
        "(num_blocks probed as 7919); supported: [2, B, N, H, D], [B, 2, N, H, D] and [B, H, N, 2*D]"
    )


def cache_hit_source_name(store: Any) -> str:
    """vLLM's ``CacheHitSource`` value for hits served by ``store``'s outermost tier.

    A shared Redis/Valkey tier is remote ("external_unspecified"); a disk or shared directory is
    "disk"; a RAM tier alone is "host".
    """
    if getattr(store, "remote_url", None):
        return "external_unspecified"
    if getattr(store, "local_disk", None) or getattr(store, "shared_dir", None):
        return "disk"
    return "host"
