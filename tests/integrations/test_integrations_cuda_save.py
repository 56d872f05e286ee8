"""On a CUDA cache, the connector's save copies the KV out on the stager's stream through
page-locked buffers: the bytes equal a plain gather, whatever the layout, and a save fenced after
the writes sees them. Runs where CUDA is present (the GPU machines); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from kvmesh.core.torch_kv import PinnedStager
from kvmesh.integrations.paged_kv import PagedGeometry, PagedLayout, gather, picked_layers, token_slots


def layer_shape(g: PagedGeometry) -> tuple[int, ...]:
    if g.layout is PagedLayout.KV_FIRST:
        return (2, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
    if g.layout is PagedLayout.BLOCKS_FIRST:
        return (g.num_blocks, 2, g.block_size, g.num_kv_heads, g.head_dim)
    return (g.num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_dim)


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("layout", list(PagedLayout))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_copy_out_equals_a_plain_gather(layout: PagedLayout, dtype: torch.dtype) -> None:
    g = PagedGeometry(layout=layout, num_blocks=16, block_size=16, num_kv_heads=2, head_dim=8, dtype=dtype)
    layers = [torch.randn(layer_shape(g), device="cuda").to(dtype) for _ in range(3)]
    slots = token_slots([5, 2, 9], 16, 3, 40)
    want = gather(layers, g, slots).cpu()
    got = torch.empty_like(want, device="cpu")
    stager = PinnedStager(torch.device("cuda"))
    stager.copy_out(picked_layers(layers, g, slots), list(got))
    assert torch.equal(got, want)


def test_a_fenced_copy_out_sees_writes_queued_before_the_fence() -> None:
    g = PagedGeometry(
        layout=PagedLayout.KV_FIRST,
        num_blocks=64,
        block_size=16,
        num_kv_heads=4,
        head_dim=64,
        dtype=torch.float16,
    )
    layers = [torch.zeros(layer_shape(g), device="cuda", dtype=g.dtype) for _ in range(4)]
    stager = PinnedStager(torch.device("cuda"))
    for layer in layers:  # long work on the engine's stream, still running when the fence is taken
        for _ in range(50):
            layer.add_(1)
    fence = stager.fence()
    slots = token_slots(list(range(64)), 16, 0, 1024)
    got = torch.empty((4, 2, 4, 1024, 64), dtype=g.dtype)
    stager.copy_out(picked_layers(layers, g, slots), list(got), after=fence)
    assert bool((got == 50).all())
