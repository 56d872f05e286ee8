"""paged_transfer: KV saved from one paged cache loads bit-identically into another, through a
real store (RAM + shared directory), across layouts, block ids and partial hits."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from integrations_helpers import bits, paged_cache, read_request, request_kv, write_request

from kvmesh.core.hashing import Namespace
from kvmesh.integrations import paged_transfer
from kvmesh.integrations.paged_kv import PagedLayout, detect_geometry
from kvmesh.integrations.paged_transfer import PagedKVTransfer
from kvmesh.integrations.request_tracker import LoadSpec, SaveSpec
from kvmesh.integrations.store_bridge import StoreBridge
from kvmesh.store.config import StoreConfig

NS = Namespace("m", kv_dtype="bfloat16", kv_layout="L3xH2xD8")
BS = 16


@pytest.fixture
def shared(tmp_path: Path) -> StoreConfig:
    return StoreConfig(chunk_size=32, shared_dir=str(tmp_path / "fleet"))


@pytest.fixture
def bridges(shared: StoreConfig) -> Iterator[tuple[StoreBridge, StoreBridge]]:
    """Two replicas' stores: separate RAM tiers, one shared directory."""
    a, b = StoreBridge(shared), StoreBridge(shared)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _transfer(layout: PagedLayout, bridge: StoreBridge, **kw: object) -> PagedKVTransfer:
    layers = paged_cache(layout, **kw)  # type: ignore[arg-type]
    return PagedKVTransfer(layers, detect_geometry(layers[0], BS), bridge)


@pytest.mark.parametrize(
    ("src_layout", "dst_layout"),
    [
        (PagedLayout.KV_FIRST, PagedLayout.KV_FIRST),
        (PagedLayout.KV_FIRST, PagedLayout.BLOCKS_FIRST),
        (PagedLayout.BLOCKS_FIRST, PagedLayout.KV_FIRST),
    ],
)
def test_round_trip_between_replicas_is_bit_identical(
    bridges: tuple[StoreBridge, StoreBridge], src_layout: PagedLayout, dst_layout: PagedLayout
) -> None:
    a, b = bridges
    src, dst = _transfer(src_layout, a), _transfer(dst_layout, b, fill=5.0)
    prompt = tuple(range(500, 600))
    kv = request_kv(100, seed=4)
    src_blocks, dst_blocks = (3, 0, 7, 9, 1, 4, 2), (11, 10, 2, 6, 8, 5, 3)
    write_request(src.layers, src_layout, src_blocks, BS, kv)
    assert src.save(SaveSpec("r", prompt[:96], src_blocks, 0, 96, NS))
    assert a.drain(10.0)
    assert src.stats.num_saved_tokens == 96

    assert b.lookup(prompt[:99], NS) == 96
    failed = dst.load(LoadSpec("r2", prompt[:96], dst_blocks, 0, 96, NS))
    assert failed == set()
    got = read_request(dst.layers, dst_layout, dst_blocks, BS, 100)
    assert torch.equal(bits(got[:, :, :, :96]), bits(kv[:, :, :, :96]))
    assert bool((got[:, :, :, 96:] == 5.0).all())  # tokens past the load untouched
    assert dst.stats.num_loaded_tokens == 96


def _stored_prompt(bridge: StoreBridge, prompt: tuple[int, ...], saved: int, seed: int) -> torch.Tensor:
    """Compute (write) a 96-token prompt's KV into a fresh paged cache, store its first ``saved``
    tokens through ``bridge`` and wait for every tier; returns the KV."""
    src = _transfer(PagedLayout.KV_FIRST, bridge)
    kv = request_kv(96, seed=seed)
    blocks = (0, 1, 2, 3, 4, 5)
    write_request(src.layers, PagedLayout.KV_FIRST, blocks, BS, kv)
    assert src.save(SaveSpec("a", prompt, blocks, 0, saved, NS))
    assert bridge.drain(10.0)
    return kv


def test_partial_hit_loads_the_shared_prefix_after_the_local_hit(
    bridges: tuple[StoreBridge, StoreBridge],
) -> None:
    a, b = bridges
    first = tuple(range(96))
    kv = _stored_prompt(a, first, 64, seed=5)  # only two chunks were computed
    dst = _transfer(PagedLayout.KV_FIRST, b, fill=5.0)
    second = first[:64] + tuple(range(9000, 9040))  # shares 64 tokens
    assert b.lookup(second[:-1], NS) == 64
    # the engine has the first block locally: load tokens 16..63 only
    dst_blocks = (7, 8, 9, 10, 11, 6, 5)
    assert dst.load(LoadSpec("b", second[:64], dst_blocks, 16, 64, NS)) == set()
    got = read_request(dst.layers, PagedLayout.KV_FIRST, dst_blocks, BS, 64)
    assert torch.equal(bits(got[:, :, :, 16:64]), bits(kv[:, :, :, 16:64]))
    assert bool((got[:, :, :, :16] == 5.0).all())
    assert dst.stats.num_loaded_tokens == 48


def test_a_span_starting_in_a_later_chunk_copies_only_what_it_covers(
    bridges: tuple[StoreBridge, StoreBridge],
) -> None:
    a, b = bridges
    prompt = tuple(range(96))
    kv = _stored_prompt(a, prompt, 96, seed=8)  # three chunks
    dst = _transfer(PagedLayout.KV_FIRST, b, fill=5.0)
    # the engine holds 48 tokens (chunk 0 and half of chunk 1): tokens 48..95 come from two chunks
    dst_blocks = (11, 10, 9, 8, 7, 6)
    assert dst.load(LoadSpec("b", prompt, dst_blocks, 48, 96, NS)) == set()
    got = read_request(dst.layers, PagedLayout.KV_FIRST, dst_blocks, BS, 96)
    assert torch.equal(bits(got[:, :, :, 48:]), bits(kv[:, :, :, 48:]))
    assert bool((got[:, :, :, :48] == 5.0).all())
    assert dst.stats.num_loaded_tokens == 48


def test_save_after_skip_writes_only_later_chunks(bridges: tuple[StoreBridge, StoreBridge]) -> None:
    a, b = bridges
    src = _transfer(PagedLayout.KV_FIRST, a)
    kv = request_kv(96, seed=6)
    blocks = (6, 5, 4, 3, 2, 1)
    write_request(src.layers, PagedLayout.KV_FIRST, blocks, BS, kv)
    prompt = tuple(range(96))
    assert src.save(SaveSpec("r", prompt, blocks, 32, 96, NS))
    assert a.drain(10.0)
    assert src.stats.num_saved_tokens == 64
    assert b.lookup(prompt, NS) == 0  # chunk 0 was not written: the prefix has a gap
    assert src.save(SaveSpec("r", prompt[:32], blocks, 0, 32, NS))
    assert a.drain(10.0)
    got = b.retrieve(prompt, NS)
    assert got.num_tokens == 96 and got.kv is not None
    assert torch.equal(torch.from_numpy(got.kv.view("int16")), bits(kv))


def test_load_short_of_the_plan_reports_the_unfilled_blocks(bridges: tuple[StoreBridge, StoreBridge]) -> None:
    a, b = bridges
    src, dst = _transfer(PagedLayout.KV_FIRST, a), _transfer(PagedLayout.KV_FIRST, b, fill=5.0)
    kv = request_kv(64, seed=7)
    write_request(src.layers, PagedLayout.KV_FIRST, (0, 1, 2, 3), BS, kv)
    prompt = tuple(range(100))
    assert src.save(SaveSpec("r", prompt[:32], (0, 1, 2, 3), 0, 32, NS))
    assert a.drain(10.0)
    # planned 64 tokens (say the store lost chunk 1 since the lookup); only 32 exist
    dst_blocks = (9, 8, 7, 6)
    assert dst.load(LoadSpec("r", prompt[:64], dst_blocks, 0, 64, NS)) == {7, 6}
    got = read_request(dst.layers, PagedLayout.KV_FIRST, dst_blocks, BS, 64)
    assert torch.equal(bits(got[:, :, :, :32]), bits(kv[:, :, :, :32]))
    assert dst.stats.num_loaded_tokens == 32 and dst.stats.num_failed_load_tokens == 32


def test_load_from_a_dead_store_reports_every_planned_block(tmp_path: Path) -> None:
    config = StoreConfig(chunk_size=32, local_cpu=False, remote_url="redis://127.0.0.1:1/0")
    with StoreBridge(config) as bridge:
        dst = _transfer(PagedLayout.BLOCKS_FIRST, bridge, fill=5.0)
        failed = dst.load(LoadSpec("r", tuple(range(64)), (4, 5, 6, 7), 16, 64, NS))
        assert failed == {5, 6, 7}
        assert bool((torch.stack(dst.layers) == 5.0).all())


def test_load_of_a_differently_shaped_chunk_is_a_miss(bridges: tuple[StoreBridge, StoreBridge]) -> None:
    a, b = bridges
    wide = _transfer(PagedLayout.KV_FIRST, a, num_kv_heads=4)
    kv = request_kv(32, num_kv_heads=4, seed=8)
    write_request(wide.layers, PagedLayout.KV_FIRST, (0, 1), BS, kv)
    prompt = tuple(range(40))
    assert wide.save(SaveSpec("r", prompt[:32], (0, 1), 0, 32, NS))
    assert a.drain(10.0)
    narrow = _transfer(PagedLayout.KV_FIRST, b, fill=5.0)
    assert narrow.load(LoadSpec("r", prompt[:32], (2, 3), 0, 32, NS)) == {2, 3}
    assert bool((torch.stack(narrow.layers) == 5.0).all())


DEVICES = ["cpu", "cuda"] if os.environ.get("KVMESH_TEST_DEVICE") == "cuda" else ["cpu"]


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_in_several_batches_is_bit_identical(
    bridges: tuple[StoreBridge, StoreBridge], monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """Loaded chunks are staged a bounded number of bytes at a time (on CUDA through page-locked
    buffers, ``KVMESH_TEST_DEVICE=cuda``): every batch lands in the right blocks."""
    a, b = bridges
    prompt = tuple(range(500, 596))
    kv = _stored_prompt(a, prompt, 96, seed=9)
    layers = [layer.to(device) for layer in paged_cache(PagedLayout.KV_FIRST, fill=5.0)]
    dst = PagedKVTransfer(layers, detect_geometry(layers[0], BS), b)
    chunk_bytes = 3 * 2 * 2 * 32 * 8 * 2  # layers × K/V × heads × chunk tokens × head dim × bf16
    monkeypatch.setattr(paged_transfer, "LOAD_BATCH_BYTES", chunk_bytes)  # one chunk per batch
    dst_blocks = (11, 10, 9, 8, 7, 6)
    assert dst.load(LoadSpec("b", prompt, dst_blocks, 16, 96, NS)) == set()
    got = read_request([layer.cpu() for layer in layers], PagedLayout.KV_FIRST, dst_blocks, BS, 96)
    assert torch.equal(bits(got[:, :, :, 16:]), bits(kv[:, :, :, 16:]))
    assert bool((got[:, :, :, :16] == 5.0).all())
