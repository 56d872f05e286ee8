"""Copy KV between a paged KV cache (vLLM's per-layer block tensors) and store arrays.

A paged cache keeps each layer's KV in fixed-size blocks; a request owns a list of block ids, and
token ``t`` of the request lives in block ``block_ids[t // block_size]`` at offset
``t % block_size`` (its *slot* is ``block_id * block_size + offset``). Three per-layer layouts are
supported, all indexed logically (a permuted stride order, such as vLLM's HND or any
``KVCacheLayout`` stride permutation, is transparent)::

    KV_FIRST         [2, num_blocks, block_size, num_kv_heads, head_dim]    vLLM ≤ 0.31 FlashAttention
    BLOCKS_FIRST     [num_blocks, 2, block_size, num_kv_heads, head_dim]    vLLM ≤ 0.31 FlashInfer
    HEADS_KV_CONCAT  [num_blocks, num_kv_heads, block_size, 2 * head_dim]   vLLM ≥ 0.32, every backend
                      K is content[:head_dim], V is content[head_dim:]       (logical [B, H, N, C] views)

The attention kernel may split each scheduler block into ``block_size // kernel_block_size``
kernel blocks (vLLM does when a backend supports only smaller blocks); the tensor then holds
kernel blocks, and scheduler block ``b`` is kernel blocks ``b * r .. b * r + r - 1``. A slot is the
same number in both views, so only the split of a slot into (block, offset) uses the kernel size.

The store speaks one array per token range shaped ``(L, 2, H, T, D)``, with bfloat16 carried as
uint16 bit patterns (numpy has no bfloat16)::

    store kv[l, k_or_v, h, t, d]  <->  layer_l[k_or_v, block(t), offset(t), h, d]   (KV_FIRST)
                                  <->  layer_l[block(t), h, offset(t), k_or_v * D + d] (HEADS_KV_CONCAT)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from kvmesh.core.torch_kv import store_dtype_name


class PagedLayout(StrEnum):
    """How one layer's paged cache tensor orders its logical axes."""

    KV_FIRST = "kv_first"
    BLOCKS_FIRST = "blocks_first"
    HEADS_KV_CONCAT = "heads_kv_concat"


@dataclass(frozen=True, slots=True)
class PagedGeometry:
    """Shape facts shared by every layer of one paged cache.

    Attributes:
        layout: how the axes are ordered.
        num_blocks: blocks per layer tensor (kernel blocks when the kernel splits blocks).
        block_size: tokens per scheduler block (what request block ids count in).
        num_kv_heads: KV heads held by this worker.
        head_dim: values per head (K and V alike).
        dtype: the cache's torch dtype.
        kernel_block_size: tokens per block of the tensor; 0 means ``block_size``.
    """

    layout: PagedLayout
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kernel_block_size: int = 0

    @property
    def tensor_block_size(self) -> int:
        """Tokens per block of the layer tensors."""
        return self.kernel_block_size or self.block_size

    @property
    def num_slots(self) -> int:
        """Token slots per layer."""
        return self.num_blocks * self.tensor_block_size

    @property
    def store_dtype(self) -> str:
        """The store's name for this dtype ("float32", "float16", "bfloat16")."""
        return store_dtype_name(self.dtype)


def detect_geometry(
    layer: torch.Tensor,
    block_size: int,
    layout: PagedLayout | None = None,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    source: str = "",
) -> PagedGeometry:
    """Read the geometry of one layer's paged cache.

    Args:
        layer: a 4-D (``HEADS_KV_CONCAT``) or 5-D (``KV_FIRST``/``BLOCKS_FIRST``) paged cache tensor.
        block_size: tokens per scheduler block; the tensor's own block may divide it.
        layout: the layout the engine declares; guessed from the shape when ``None``.
        num_kv_heads: the model's KV heads per worker, checked when given.
        head_dim: the model's head size, checked when given (and required to tell K from V when
            the content axis is odd-sized or K and V differ).
        source: who declared the layout (an attention backend's name), for error messages.

    Raises:
        ValueError: the tensor does not fit the layout (or fits none, or both 5-D ones with no
            layout given), K and V have different head sizes, or the dtype cannot be stored.
    """
    shape = tuple(layer.shape)
    origin = f" (declared by {source})" if source else ""
    if layout is None:
        layout = _guess_layout(shape)
    if layout is PagedLayout.HEADS_KV_CONCAT:
        if layer.dim() != 4:
            raise ValueError(
                f"{layout.value} paged KV layer must be [blocks, heads, tokens, 2*dim]{origin}, got {list(shape)}"
            )
        num_blocks, heads, tokens, content = shape
        dim = head_dim if head_dim is not None else content // 2
        if content != 2 * dim:
            raise ValueError(
                f"paged KV layer {list(shape)}{origin} has K and V of different head sizes "
                f"(content {content}, K head size {dim}); store chunks carry one head size for K and V"
            )
    else:
        if layer.dim() != 5:
            raise ValueError(
                f"paged KV layer must be [2, blocks, tokens, heads, dim] or [blocks, 2, tokens, heads, dim]"
                f"{origin}, got {list(shape)}"
            )
        kv_axis = shape[0] if layout is PagedLayout.KV_FIRST else shape[1]
        if kv_axis != 2:
            raise ValueError(f"paged KV layer shape {list(shape)}{origin} is not {layout.value}")
        num_blocks = shape[1] if layout is PagedLayout.KV_FIRST else shape[0]
        tokens, heads, dim = shape[2], shape[3], shape[4]
    if tokens <= 0 or block_size % tokens:
        raise ValueError(
            f"paged KV layer {list(shape)}{origin} holds {tokens}-token blocks, which do not divide "
            f"the engine's block size {block_size}"
        )
    if num_blocks % (block_size // tokens):
        raise ValueError(
            f"paged KV layer {list(shape)}{origin} holds {num_blocks} kernel blocks, not a whole number "
            f"of {block_size}-token blocks"
        )
    if num_kv_heads is not None and heads != num_kv_heads:
        raise ValueError(
            f"paged KV layer {list(shape)}{origin} holds {heads} KV heads, the model {num_kv_heads}"
        )
    if head_dim is not None and dim != head_dim:
        raise ValueError(f"paged KV layer {list(shape)}{origin} holds head size {dim}, the model {head_dim}")
    store_dtype_name(layer.dtype)
    kernel = 0 if tokens == block_size else tokens
    return PagedGeometry(layout, num_blocks, block_size, heads, dim, layer.dtype, kernel)


def _guess_layout(shape: tuple[int, ...]) -> PagedLayout:
    if len(shape) == 4:
        return PagedLayout.HEADS_KV_CONCAT
    if len(shape) != 5:
        raise ValueError(f"paged KV layer must be a 4-D or 5-D tensor, got {list(shape)}")
    kv_first, blocks_first = shape[0] == 2, shape[1] == 2
    if kv_first and blocks_first:
        raise ValueError(f"paged KV layer shape {list(shape)} fits both layouts; pass the layout")
    if not (kv_first or blocks_first):
        raise ValueError(f"paged KV layer shape {list(shape)} has no K/V axis of size 2")
    return PagedLayout.KV_FIRST if kv_first else PagedLayout.BLOCKS_FIRST


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
    n = g.tensor_block_size
    if g.layout is PagedLayout.KV_FIRST:
        return (2, g.num_blocks, n, g.num_kv_heads, g.head_dim)
    if g.layout is PagedLayout.BLOCKS_FIRST:
        return (g.num_blocks, 2, n, g.num_kv_heads, g.head_dim)
    return (g.num_blocks, g.num_kv_heads, n, 2 * g.head_dim)


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
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= g.num_slots):
        raise ValueError(f"slots must lie in [0, {g.num_slots}), got {int(slots.min())}..{int(slots.max())}")
    slots = slots.to(device=device, dtype=torch.int64)
    n = g.tensor_block_size
    return slots // n, slots % n


def _flat_slots(layer: torch.Tensor, g: PagedGeometry) -> torch.Tensor | None:
    """``layer`` viewed as [2, num_slots, heads, dim] without copying, when its strides allow it
    (a contiguous KV_FIRST cache); ``None`` otherwise."""
    if g.layout is not PagedLayout.KV_FIRST:
        return None
    try:
        return layer.view(2, g.num_slots, g.num_kv_heads, g.head_dim)
    except RuntimeError:
        return None


def _pick(layer: torch.Tensor, g: PagedGeometry, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The KV of the given (block, offset) positions of one layer, as (2, T, H, D)."""
    if g.layout is PagedLayout.KV_FIRST:
        return layer[:, blocks, offsets]
    if g.layout is PagedLayout.BLOCKS_FIRST:
        return layer[blocks, :, offsets].transpose(0, 1)  # (T, 2, H, D) -> (2, T, H, D)
    picked = layer[blocks, :, offsets]  # (T, H, 2D)
    return picked.reshape(picked.shape[0], g.num_kv_heads, 2, g.head_dim).permute(2, 0, 1, 3)


def _put(
    layer: torch.Tensor, g: PagedGeometry, blocks: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor
) -> None:
    """Write ``values`` (2, T, H, D) at the given (block, offset) positions of one layer."""
    if g.layout is PagedLayout.KV_FIRST:
        layer[:, blocks, offsets] = values
    elif g.layout is PagedLayout.BLOCKS_FIRST:
        layer[blocks, :, offsets] = values.transpose(0, 1)
    else:
        layer[blocks, :, offsets] = values.permute(1, 2, 0, 3).reshape(values.shape[1], g.num_kv_heads, -1)


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
    for n, picked in enumerate(picked_layers(layers, g, slots)):
        out[n].copy_(picked)
    return out


def picked_layers(
    layers: Sequence[torch.Tensor], geometry: PagedGeometry, slots: torch.Tensor
) -> Iterator[torch.Tensor]:
    """The KV at ``slots`` of each layer in turn, as (2, H, T, D) on the layers' device.

    Lazy: each layer's gather is queued when its tensor is drawn, on the stream current then.

    Raises:
        ValueError: a slot outside the cache.
    """
    g = geometry
    blocks, offsets = _split(slots, g, layers[0].device)
    flat_slots = slots.to(device=layers[0].device, dtype=torch.int64)
    for layer in layers:
        flat = _flat_slots(layer, g)
        picked = flat.index_select(1, flat_slots) if flat is not None else _pick(layer, g, blocks, offsets)
        yield picked.permute(0, 2, 1, 3)


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
        else:
            _put(layer, geometry, blocks, offsets, values)
