"""Copy KV between a paged KV cache (vLLM's per-layer block tensors) and store arrays.

A paged cache keeps each layer's KV in fixed-size blocks; a request owns a list of block ids, and
token ``t`` of the request lives in block ``block_ids[t // block_size]`` at offset
``t % block_size`` (its *slot* is ``block_id * block_size + offset``). Two per-layer layouts are
supported, both indexed logically (a permuted stride order, such as vLLM's HND, is transparent)::

    KV_FIRST      [2, num_blocks, block_size, num_kv_heads, head_dim]   FlashAttention
    BLOCKS_FIRST  [num_blocks, 2, block_size, num_kv_heads, head_dim]   FlashInfer

The store speaks one array per token range shaped ``(L, 2, H, T, D)``, with bfloat16 carried as
uint16 bit patterns (numpy has no bfloat16)::

    store kv[l, k_or_v, h, t, d]  <->  layer_l[k_or_v, block(t), offset(t), h, d]   (KV_FIRST)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch

_STORE_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


class PagedLayout(StrEnum):
    """Where the K/V axis sits in one layer's paged cache tensor."""

    KV_FIRST = "kv_first"
    BLOCKS_FIRST = "blocks_first"


@dataclass(frozen=True, slots=True)
class PagedGeometry:
    """Shape facts shared by every layer of one paged cache.

    Attributes:
        layout: where the K/V axis is.
        num_blocks: blocks per layer.
        block_size: tokens per block.
        num_kv_heads: KV heads held by this worker.
        head_dim: values per head.
        dtype: the cache's torch dtype.
    """

    layout: PagedLayout
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def store_dtype(self) -> str:
        """The store's name for this dtype ("float32", "float16", "bfloat16")."""
        return store_dtype_name(self.dtype)


def store_dtype_name(dtype: torch.dtype) -> str:
    """The store's KV dtype name for a torch dtype.

    Raises:
        ValueError: a dtype the store cannot carry (e.g. an fp8 KV cache).
    """
    name = _STORE_DTYPES.get(dtype)
    if name is None:
        raise ValueError(f"KV cache dtype must be float32, float16 or bfloat16, got {dtype}")
    return name


def detect_geometry(layer: torch.Tensor, block_size: int, layout: PagedLayout | None = None) -> PagedGeometry:
    """Read the geometry of one layer's paged cache.

    Args:
        layer: a 5-D paged cache tensor.
        block_size: tokens per block (the engine's setting; it disambiguates the shape).
        layout: force a layout; detected from the shape when ``None``.

    Raises:
        ValueError: the tensor matches neither layout, or matches both (say, two blocks) and no
            layout was given.
    """
    shape = tuple(layer.shape)
    if layer.dim() != 5 or shape[2] != block_size:
        raise ValueError(
            f"paged KV layer must be [2, blocks, {block_size}, heads, dim] or "
            f"[blocks, 2, {block_size}, heads, dim], got {list(shape)}"
        )
    if layout is None:
        kv_first = shape[0] == 2
        blocks_first = shape[1] == 2
        if kv_first and blocks_first:
            raise ValueError(f"paged KV layer shape {list(shape)} fits both layouts; pass the layout")
        if not (kv_first or blocks_first):
            raise ValueError(f"paged KV layer shape {list(shape)} has no K/V axis of size 2")
        layout = PagedLayout.KV_FIRST if kv_first else PagedLayout.BLOCKS_FIRST
    num_blocks = shape[1] if layout is PagedLayout.KV_FIRST else shape[0]
    kv_axis = shape[0] if layout is PagedLayout.KV_FIRST else shape[1]
    if kv_axis != 2:
        raise ValueError(f"paged KV layer shape {list(shape)} is not {layout.value}")
    store_dtype_name(layer.dtype)
    return PagedGeometry(layout, num_blocks, block_size, shape[3], shape[4], layer.dtype)


def check_layers(layers: Sequence[torch.Tensor], geometry: PagedGeometry) -> None:
    """Check that every layer has ``geometry``'s shape and dtype.

    Raises:
        ValueError: the first layer that differs, with both shapes.
    """
    want = _layer_shape(geometry)
    for n, layer in enumerate(layers):
        if tuple(layer.shape) != want or layer.dtype != geometry.dtype:
            raise ValueError(
                f"layer {n} is {list(layer.shape)} {layer.dtype}, expected {list(want)} {geometry.dtype}"
            )


def _layer_shape(g: PagedGeometry) -> tuple[int, ...]:
    if g.layout is PagedLayout.KV_FIRST:
        return (2, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
    return (g.num_blocks, 2, g.block_size, g.num_kv_heads, g.head_dim)


def token_slots(block_ids: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Slots of request tokens ``start..end-1`` (int64, on the CPU).

    Raises:
        ValueError: the range is empty-or-negative, or ``block_ids`` do not cover ``end`` tokens.
    """
    if not 0 <= start <= end:
        raise ValueError(f"token range must satisfy 0 <= start <= end, got {start}..{end}")
    if end > len(block_ids) * block_size:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} tokens cannot hold tokens up to {end}")
    positions = torch.arange(start, end, dtype=torch.int64)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.int64)
    return blocks[positions // block_size] * block_size + positions % block_size


def _split(slots: torch.Tensor, g: PagedGeometry, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= g.num_blocks * g.block_size):
        raise ValueError(
            f"slots must lie in [0, {g.num_blocks * g.block_size}), got {int(slots.min())}..{int(slots.max())}"
        )
    slots = slots.to(device=device, dtype=torch.int64)
    return slots // g.block_size, slots % g.block_size


def _flat_slots(layer: torch.Tensor, g: PagedGeometry) -> torch.Tensor | None:
    """``layer`` viewed as [2, num_blocks * block_size, heads, dim] without copying, when its
    strides allow it (a contiguous KV_FIRST cache); ``None`` otherwise."""
    if g.layout is not PagedLayout.KV_FIRST:
        return None
    try:
        return layer.view(2, g.num_blocks * g.block_size, g.num_kv_heads, g.head_dim)
    except RuntimeError:
        return None


def gather(
    layers: Sequence[torch.Tensor],
    geometry: PagedGeometry,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy the KV at ``slots`` out of every layer.

    Args:
        layers: the paged cache, one tensor per layer, all of ``geometry``.
        geometry: their shape.
        slots: one slot per token, in token order.
        out: where to write, shaped (L, 2, H, T, D) with the layers' dtype; a new tensor on the
            layers' device when ``None``.

    Returns:
        ``out``, or the new tensor.

    Raises:
        ValueError: a slot outside the cache, or ``out`` of the wrong shape or dtype.
    """
    if not layers:
        raise ValueError("gather needs at least one layer")
    g = geometry
    want = (len(layers), 2, g.num_kv_heads, slots.numel(), g.head_dim)
    if out is None:
        out = torch.empty(want, dtype=g.dtype, device=layers[0].device)
    elif tuple(out.shape) != want or out.dtype != g.dtype:
        raise ValueError(f"out must be {list(want)} {g.dtype}, got {list(out.shape)} {out.dtype}")
    blocks, offsets = _split(slots, g, layers[0].device)
    flat_slots = slots.to(device=layers[0].device, dtype=torch.int64)
    for n, layer in enumerate(layers):
        flat = _flat_slots(layer, g)
        if flat is not None:
            picked = flat.index_select(1, flat_slots)  # (2, T, H, D)
        elif g.layout is PagedLayout.KV_FIRST:
            picked = layer[:, blocks, offsets]  # (2, T, H, D)
        else:
            picked = layer[blocks, :, offsets].transpose(0, 1)  # (T, 2, H, D) -> (2, T, H, D)
        out[n].copy_(picked.permute(0, 2, 1, 3))
    return out


def scatter(
    layers: Sequence[torch.Tensor], geometry: PagedGeometry, slots: torch.Tensor, kv: torch.Tensor
) -> None:
    """Write ``kv`` (L, 2, H, T, D) into every layer at ``slots``, in place.

    Raises:
        ValueError: ``kv`` disagrees with the layers (count, heads, head size, dtype) or with the
            number of slots, or a slot lies outside the cache.
    """
    want = (len(layers), 2, geometry.num_kv_heads, slots.numel(), geometry.head_dim)
    if tuple(kv.shape) != want:
        raise ValueError(f"kv must be shaped {list(want)} for these layers and slots, got {list(kv.shape)}")
    if kv.dtype != geometry.dtype:
        raise ValueError(f"kv dtype {kv.dtype} differs from the cache dtype {geometry.dtype}")
    if not layers:
        return
    device = layers[0].device
    blocks, offsets = _split(slots, geometry, device)
    flat_slots = slots.to(device=device, dtype=torch.int64)
    kv = kv.to(device)
    for n, layer in enumerate(layers):
        values = kv[n].permute(0, 2, 1, 3)  # (2, T, H, D)
        flat = _flat_slots(layer, geometry)
        if flat is not None:
            flat.index_copy_(1, flat_slots, values)
        elif geometry.layout is PagedLayout.KV_FIRST:
            layer[:, blocks, offsets] = values
        else:
            layer[blocks, :, offsets] = values.transpose(0, 1)


def to_store_array(kv: torch.Tensor) -> np.ndarray:
    """A CPU numpy array of ``kv`` in the store's dtype (bfloat16 → uint16 bit patterns)."""
    kv = kv.detach().to("cpu").contiguous()
    if kv.dtype == torch.bfloat16:
        return kv.view(torch.int16).numpy().view(np.uint16)
    store_dtype_name(kv.dtype)
    return kv.numpy()


def from_store_array(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``dtype`` from a store array (uint16 bit patterns when ``dtype`` is bfloat16).

    Raises:
        ValueError: the array's dtype cannot hold ``dtype``'s values bit for bit.
    """
    if dtype == torch.bfloat16:
        if array.dtype != np.uint16:
            raise ValueError(f"bfloat16 KV must arrive as uint16 bit patterns, got {array.dtype}")
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    name = store_dtype_name(dtype)
    if array.dtype.name != name:
        raise ValueError(f"store array is {array.dtype}, the cache is {name}")
    return torch.from_numpy(array)
