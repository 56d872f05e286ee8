"""paged_kv: geometry detection, slots, gather/scatter against an element-wise reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from integrations_helpers import bits, paged_cache, read_request, request_kv, write_request

from kvmesh.core.torch_kv import from_store_array, store_dtype_name, to_store_array
from kvmesh.integrations.paged_kv import (
    PagedLayout,
    check_layers,
    detect_geometry,
    gather,
    scatter,
    token_slots,
)

LAYOUTS = list(PagedLayout)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_detect_geometry_reads_both_layouts(layout: PagedLayout) -> None:
    layers = paged_cache(layout, num_blocks=12, block_size=16, num_kv_heads=2, head_dim=8)
    g = detect_geometry(layers[0], 16)
    assert (g.layout, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim) == (layout, 12, 16, 2, 8)
    assert g.store_dtype == "bfloat16"
    check_layers(layers, g)


def test_detect_geometry_ambiguous_shape_needs_a_layout() -> None:
    layer = torch.zeros((2, 2, 16, 2, 8))
    with pytest.raises(ValueError, match="both layouts"):
        detect_geometry(layer, 16)
    assert detect_geometry(layer, 16, PagedLayout.BLOCKS_FIRST).layout is PagedLayout.BLOCKS_FIRST


@pytest.mark.parametrize(
    ("shape", "dtype", "message"),
    [
        ((2, 4, 12, 2, 8), torch.float16, "do not divide"),  # 12-token blocks in 16-token pages
        ((2, 3, 8, 2, 8), torch.float16, "whole number"),  # 3 kernel blocks of 8 ≠ k pages of 16
        ((3, 4, 16, 2, 8), torch.float16, "no K/V axis"),
        ((4, 16, 8), torch.float16, "4-D or 5-D"),
        ((2, 4, 16, 2, 8), torch.int8, "float32, float16 or bfloat16"),
    ],
)
def test_detect_geometry_rejects_other_tensors(
    shape: tuple[int, ...], dtype: torch.dtype, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        detect_geometry(torch.zeros(shape, dtype=dtype), 16)


def test_check_layers_names_the_odd_layer() -> None:
    layers = paged_cache(PagedLayout.KV_FIRST)
    g = detect_geometry(layers[0], 16)
    layers[2] = layers[2].to(torch.float16)
    with pytest.raises(ValueError, match="layer 2"):
        check_layers(layers, g)


def test_token_slots_follow_block_ids() -> None:
    slots = token_slots([7, 2, 5], 4, 2, 10)
    assert slots.tolist() == [30, 31, 8, 9, 10, 11, 20, 21]
    assert token_slots([7], 4, 3, 3).tolist() == []
    with pytest.raises(ValueError, match="cannot hold"):
        token_slots([7, 2], 4, 0, 9)
    with pytest.raises(ValueError, match="start <= end"):
        token_slots([7, 2], 4, 5, 4)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_matches_elementwise_reference(layout: PagedLayout, dtype: torch.dtype) -> None:
    layers = paged_cache(layout, dtype=dtype, fill=-1.0)
    block_ids = [9, 3, 11, 0]
    kv = request_kv(56, dtype=dtype, seed=1)
    write_request(layers, layout, block_ids, 16, kv)
    g = detect_geometry(layers[0], 16)
    out = gather(layers, g, token_slots(block_ids, 16, 0, 56))
    assert out.shape == (3, 2, 2, 56, 8)
    assert torch.equal(bits(out), bits(kv))
    tail = gather(layers, g, token_slots(block_ids, 16, 20, 40))
    assert torch.equal(bits(tail), bits(kv[:, :, :, 20:40]))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_writes_only_the_given_slots(layout: PagedLayout, dtype: torch.dtype) -> None:
    layers = paged_cache(layout, dtype=dtype, fill=7.0)
    before = [t.clone() for t in layers]
    g = detect_geometry(layers[0], 16)
    block_ids = [4, 1, 8]
    kv = request_kv(40, dtype=dtype, seed=2)
    scatter(layers, g, token_slots(block_ids, 16, 10, 40), kv[:, :, :, 10:40])
    got = read_request(layers, layout, block_ids, 16, 40)
    assert torch.equal(bits(got[:, :, :, 10:40]), bits(kv[:, :, :, 10:40]))
    assert bool((got[:, :, :, :10] == 7.0).all())  # tokens before the range untouched
    untouched = [b for b in range(12) if b not in block_ids]
    for new, old in zip(layers, before, strict=True):
        if layout is PagedLayout.KV_FIRST:
            assert torch.equal(new[:, untouched], old[:, untouched])
        else:
            assert torch.equal(new[untouched], old[untouched])


def test_scatter_rejects_mismatched_kv() -> None:
    layers = paged_cache(PagedLayout.KV_FIRST)
    g = detect_geometry(layers[0], 16)
    slots = token_slots([1, 2], 16, 0, 20)
    with pytest.raises(ValueError, match="shaped"):
        scatter(layers, g, slots, request_kv(19))
    with pytest.raises(ValueError, match="dtype"):
        scatter(layers, g, slots, request_kv(20, dtype=torch.float16))
    with pytest.raises(ValueError, match="slots must lie"):
        scatter(layers, g, token_slots([1, 12], 16, 0, 20), request_kv(20))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_array_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    kv = request_kv(9, dtype=dtype, seed=3)
    kv[0, 0, 0, 0, 0] = float("nan")
    kv[0, 0, 0, 0, 1] = float("-inf")
    kv[0, 0, 0, 0, 2] = -0.0
    array = to_store_array(kv)
    assert (
        array.dtype
        == {torch.bfloat16: np.uint16, torch.float16: np.float16, torch.float32: np.float32}[dtype]
    )
    back = from_store_array(array, dtype)
    assert torch.equal(bits(back), bits(kv))


def test_store_array_dtype_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="uint16"):
        from_store_array(np.zeros((1, 2, 1, 1, 1), np.float16), torch.bfloat16)
    with pytest.raises(ValueError, match="float16"):
        from_store_array(np.zeros((1, 2, 1, 1, 1), np.float32), torch.float16)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        store_dtype_name(torch.float8_e4m3fn)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_permuted_strides_hnd_cache_round_trips(layout: PagedLayout) -> None:
    """A cache whose memory is heads-before-tokens (vLLM's HND) but whose logical shape is the usual one."""
    if layout is PagedLayout.HEADS_KV_CONCAT:
        layers = [torch.zeros((12, 16, 2, 16), dtype=torch.float16).permute(0, 2, 1, 3) for _ in range(3)]
    elif layout is PagedLayout.KV_FIRST:
        layers = [
            torch.zeros((2, 12, 2, 16, 8), dtype=torch.float16).permute(0, 1, 3, 2, 4) for _ in range(3)
        ]
    else:
        layers = [
            torch.zeros((12, 2, 2, 16, 8), dtype=torch.float16).permute(0, 1, 3, 2, 4) for _ in range(3)
        ]
    assert not layers[0].is_contiguous()
    g = detect_geometry(layers[0], 16)
    block_ids = [10, 2, 6]
    kv = request_kv(40, dtype=torch.float16, seed=9)
    scatter(layers, g, token_slots(block_ids, 16, 0, 40), kv)
    assert torch.equal(bits(read_request(layers, layout, block_ids, 16, 40)), bits(kv))
    assert torch.equal(bits(gather(layers, g, token_slots(block_ids, 16, 0, 40))), bits(kv))


def test_gather_into_a_given_buffer() -> None:
    layers = paged_cache(PagedLayout.KV_FIRST)
    g = detect_geometry(layers[0], 16)
    kv = request_kv(32, seed=10)
    write_request(layers, PagedLayout.KV_FIRST, [3, 4], 16, kv)
    out = torch.zeros((3, 2, 2, 48, 8), dtype=torch.bfloat16)
    gather(layers, g, token_slots([3, 4], 16, 0, 32), out=out[:, :, :, 16:, :])
    assert torch.equal(bits(out[:, :, :, 16:]), bits(kv))
    assert bool((out[:, :, :, :16] == 0).all())
    with pytest.raises(ValueError, match="out must be"):
        gather(layers, g, token_slots([3, 4], 16, 0, 32), out=out)


# vLLM >= 0.32 hands every attention backend logical [B, H, N, C] views of one allocation whose
# physical axis order is a KVCacheLayout stride permutation over [L, B, H, N, C] (RFC 42082).
VLLM_STRIDE_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def vllm_views(
    order: tuple[int, ...], *, num_layers: int, num_blocks: int, heads: int, tokens: int, content: int
) -> list[torch.Tensor]:
    """Per-layer logical [B, H, N, C] views of one buffer laid out physically in ``order``."""
    logical = (num_layers, num_blocks, heads, tokens, content)
    physical = torch.zeros(tuple(logical[d] for d in order), dtype=torch.bfloat16)
    inverse = [order.index(d) for d in range(5)]
    view = physical.permute(*inverse)
    assert tuple(view.shape) == logical
    return [view[layer] for layer in range(num_layers)]


@pytest.mark.parametrize("order_name", sorted(VLLM_STRIDE_ORDERS))
def test_vllm_logical_views_round_trip_in_every_stride_order(order_name: str) -> None:
    layers = vllm_views(
        VLLM_STRIDE_ORDERS[order_name], num_layers=3, num_blocks=12, heads=2, tokens=16, content=16
    )
    g = detect_geometry(layers[0], 16, PagedLayout.HEADS_KV_CONCAT, num_kv_heads=2, head_dim=8)
    check_layers(layers, g)
    block_ids = [11, 0, 5]
    kv = request_kv(44, seed=4)
    scatter(layers, g, token_slots(block_ids, 16, 0, 44), kv)
    # K lands in content[:8] and V in content[8:], by the layout's definition, not by paged_kv's.
    assert torch.equal(bits(read_request(layers, PagedLayout.HEADS_KV_CONCAT, block_ids, 16, 44)), bits(kv))
    assert torch.equal(bits(layers[1][0, 1, 3, :8]), bits(kv[1, 0, 1, 16 + 3]))
    assert torch.equal(bits(layers[1][0, 1, 3, 8:]), bits(kv[1, 1, 1, 16 + 3]))
    assert torch.equal(bits(gather(layers, g, token_slots(block_ids, 16, 0, 44))), bits(kv))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_blocks_that_split_scheduler_blocks(layout: PagedLayout) -> None:
    """128-token scheduler blocks held as 4 kernel blocks of 32: block b is kernel blocks 4b..4b+3."""
    layers = paged_cache(layout, num_blocks=24, block_size=32)
    g = detect_geometry(layers[0], 128, layout)
    assert (g.block_size, g.tensor_block_size, g.num_blocks, g.num_slots) == (128, 32, 24, 768)
    block_ids = [5, 1]
    kernel_ids = [b * 4 + j for b in block_ids for j in range(4)]
    kv = request_kv(200, seed=5)
    scatter(layers, g, token_slots(block_ids, 128, 0, 200), kv)
    assert torch.equal(bits(read_request(layers, layout, kernel_ids, 32, 200)), bits(kv))
    assert torch.equal(bits(gather(layers, g, token_slots(block_ids, 128, 60, 200))), bits(kv[:, :, :, 60:]))
    with pytest.raises(ValueError, match="slots must lie"):
        gather(layers, g, token_slots([6], 128, 0, 1))


def test_declared_facts_are_checked_with_the_backend_named() -> None:
    layer = torch.zeros((12, 2, 16, 16), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"CPU_ATTN.*2 KV heads, the model 4"):
        detect_geometry(layer, 16, PagedLayout.HEADS_KV_CONCAT, num_kv_heads=4, source="CPU_ATTN")
    with pytest.raises(ValueError, match="different head sizes"):
        detect_geometry(layer, 16, PagedLayout.HEADS_KV_CONCAT, head_dim=6)
    with pytest.raises(ValueError, match="must be \\[blocks, heads"):
        detect_geometry(torch.zeros((2, 12, 16, 2, 8)), 16, PagedLayout.HEADS_KV_CONCAT)
