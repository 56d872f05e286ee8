"""Builders shared by the integration tests: paged caches filled with known KV."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.integrations.paged_kv import PagedLayout


def paged_cache(
    layout: PagedLayout,
    *,
    num_layers: int = 3,
    num_blocks: int = 12,
    block_size: int = 16,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    fill: float | None = None,
) -> list[torch.Tensor]:
    """One zeroed (or ``fill``-ed) paged cache tensor per layer."""
    if layout is PagedLayout.KV_FIRST:
        shape: tuple[int, ...] = (2, num_blocks, block_size, num_kv_heads, head_dim)
    elif layout is PagedLayout.BLOCKS_FIRST:
        shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    else:
        shape = (num_blocks, num_kv_heads, block_size, 2 * head_dim)
    value = 0.0 if fill is None else fill
    return [torch.full(shape, value, dtype=dtype) for _ in range(num_layers)]


def request_kv(
    num_tokens: int,
    *,
    num_layers: int = 3,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> torch.Tensor:
    """Random KV (L, 2, H, T, D) standing for what a model computed for a prompt."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((num_layers, 2, num_kv_heads, num_tokens, head_dim), generator=gen).to(dtype)


def _element(layer: torch.Tensor, layout: PagedLayout, k_or_v: int, block: int, offset: int) -> torch.Tensor:
    """The (heads, dim) view of one token's K or V, by the layout's definition."""
    if layout is PagedLayout.KV_FIRST:
        return layer[k_or_v, block, offset]
    if layout is PagedLayout.BLOCKS_FIRST:
        return layer[block, k_or_v, offset]
    dim = layer.shape[3] // 2
    return layer[block, :, offset, k_or_v * dim : (k_or_v + 1) * dim]


def write_request(
    layers: Sequence[torch.Tensor],
    layout: PagedLayout,
    block_ids: Sequence[int],
    block_size: int,
    kv: torch.Tensor,
) -> None:
    """Place ``kv`` in the blocks, written element by element (independent of paged_kv's indexing)."""
    for layer_idx, layer in enumerate(layers):
        for t in range(kv.shape[3]):
            block, offset = block_ids[t // block_size], t % block_size
            for k_or_v in range(2):
                _element(layer, layout, k_or_v, block, offset).copy_(kv[layer_idx, k_or_v, :, t, :])


def read_request(
    layers: Sequence[torch.Tensor],
    layout: PagedLayout,
    block_ids: Sequence[int],
    block_size: int,
    num_tokens: int,
) -> torch.Tensor:
    """Read tokens 0..num_tokens-1 back, element by element."""
    if layout is PagedLayout.HEADS_KV_CONCAT:
        num_heads, head_dim = layers[0].shape[1], layers[0].shape[3] // 2
    else:
        num_heads, head_dim = layers[0].shape[3], layers[0].shape[4]
    out = torch.empty((len(layers), 2, num_heads, num_tokens, head_dim), dtype=layers[0].dtype)
    for layer_idx, layer in enumerate(layers):
        for t in range(num_tokens):
            block, offset = block_ids[t // block_size], t % block_size
            for k_or_v in range(2):
                out[layer_idx, k_or_v, :, t, :] = _element(layer, layout, k_or_v, block, offset)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a float tensor, for bit-identical comparisons (NaN-safe)."""
    width = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[t.dtype]
    return t.contiguous().view(width)
