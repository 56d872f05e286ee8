"""paged_kv: geometry detection, slots, gather/scatter against an element-wise reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from integrations_helpers import bits, paged_cache, read_request, request_kv, write_request

from kvmesh.integrations.paged_kv import (
    PagedLayout,
    check_layers,
    detect_geometry,
    from_store_array,
    gather,
    scatter,
    store_dtype_name,
    to_store_array,
    token_slots,
)

LAYOUTS = [PagedLayout.KV_FIRST, PagedLayout.BLOCKS_FIRST]
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
        ((2, 4, 8, 2, 8), torch.float16, "got"),  # block size 8 is not the engine's 16
        ((3, 4, 16, 2, 8), torch.float16, "no K/V axis"),
        ((4, 16, 2, 8), torch.float16, "must be"),
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
    if layout is PagedLayout.KV_FIRST:
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
