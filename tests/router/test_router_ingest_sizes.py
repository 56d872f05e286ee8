"""EventApplier: engine block sizes other than the router's, and vLLM KV cache groups."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import msgspec
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from kvmesh.core.events import BlockRemoved, BlockStored
from kvmesh.core.hashing import BlockHasher, Namespace
from kvmesh.core.types import Medium, PodId
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.gateway import Gateway
from kvmesh.router.index import InMemoryIndex, medium_set
from kvmesh.router.ingest import EventApplier
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.prefix import iter_block_keys, match_prefix
from kvmesh.router.scheduler import Scheduler, load_scheduler_config
from kvmesh.router.types import RoutingRequest

MODEL = "m"
A, B, C = PodId("http://a:1"), PodId("http://b:1"), PodId("http://c:1")
TOKENS = list(range(5000, 5000 + 128 * 4))


def make(block_size: int = 16, **kwargs: Any) -> tuple[InMemoryIndex, EventApplier]:
    idx = InMemoryIndex()
    return idx, EventApplier(idx, model=MODEL, block_size=block_size, **kwargs)


def hasher(block_size: int = 16, tenant: str = "") -> BlockHasher:
    return BlockHasher(Namespace(MODEL, tenant=tenant), block_size)


class _StoredWithKind(BlockStored):
    """BlockStored with vLLM 0.32's cache-spec fields, for an events module that lacks them."""

    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


def stored(*args: Any, kind: str | None = None, **kwargs: Any) -> BlockStored:
    if "kv_cache_spec_kind" in BlockStored.__struct_fields__:
        return BlockStored(*args, kv_cache_spec_kind=kind, **kwargs)  # type: ignore[call-arg]
    return _StoredWithKind(*args, kv_cache_spec_kind=kind, **kwargs)


# ---------------------------------------------------------------- engine blocks k × router blocks


def test_128_token_blocks_are_indexed_as_router_blocks():
    idx, ap = make()
    ap.apply(A, BlockStored([101, 102], None, TOKENS[:256], 128))
    m = match_prefix(idx, hasher(), TOKENS)
    assert m.pods[A].num_blocks == 16
    assert m.hit_tokens(A) == 256
    assert idx.stats().num_keys == 16
    assert idx.lookup(hasher().hash_blocks(TOKENS[:256])) == [{A: medium_set(Medium.GPU)}] * 16
    assert ap.num_blocks(A) == 2
    assert ap.pod_block_size(A) == 128
    assert ap.stats.num_blocks_stored == 2
    assert ap.stats.num_bad_events == ap.stats.num_block_size_mismatch == 0


def test_align_match_rounds_to_the_pods_engine_blocks():
    idx, ap = make()
    ap.apply(A, BlockStored([101, 102], None, TOKENS[:256], 128))
    ap.apply(B, BlockStored([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], None, TOKENS[:208], 16))
    prompt = TOKENS[:200] + [7] * 100  # leaves the cached prefix inside A's engine block 1
    m = match_prefix(idx, hasher(), prompt)
    assert m.hit_tokens(A) == 192  # every sub-key up to the divergence is indexed
    assert ap.align_match(m) is m
    assert m.hit_tokens(A) == 128  # ... but the engine only reuses whole 128-token blocks
    assert m.pods[A].blocks_by_tier == {Medium.GPU: 8}
    assert m.hit_tokens(B) == 192  # a 16-token pod keeps its 16-token granularity
    short = ap.align_match(match_prefix(idx, hasher(), TOKENS[:100] + [7] * 100))
    assert set(short.pods) == {B} and short.hit_tokens(B) == 96


def test_align_match_trims_the_slowest_tier_first():
    idx, ap = make()
    ap.apply(A, BlockStored([101], None, TOKENS[:128], 128))
    ap.apply(A, BlockStored([102], 101, TOKENS[128:256], 128, medium="CPU"))
    m = match_prefix(idx, hasher(), TOKENS[:200] + [7] * 100)
    assert m.pods[A].blocks_by_tier == {Medium.GPU: 8, Medium.CPU: 4}
    assert ap.align_match(m).pods[A].blocks_by_tier == {Medium.GPU: 8}


def test_chain_continues_from_the_last_sub_key_of_a_128_token_parent():
    idx, ap = make()
    ap.apply(A, BlockStored([101], None, TOKENS[:128], 128))
    ap.apply(A, BlockStored([102, 103], 101, TOKENS[128:384], 128))
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 24
    assert idx.lookup(hasher().hash_blocks(TOKENS[:384]))[-1] == {A: medium_set(Medium.GPU)}
    # a router-size block chained on a 128-token parent (a pod publishing both sizes)
    ap.apply(B, BlockStored([1], None, TOKENS[:128], 128))
    ap.apply(B, BlockStored([2], 1, TOKENS[128:144], 16))
    assert match_prefix(idx, hasher(), TOKENS).pods[B].num_blocks == 9
    # and a 128-token block chained on router-size parents
    ap.apply(C, BlockStored(list(range(1, 9)), None, TOKENS[:128], 16))
    ap.apply(C, BlockStored([9], 8, TOKENS[128:256], 128))
    assert match_prefix(idx, hasher(), TOKENS).pods[C].num_blocks == 16
    assert ap.stats.num_orphans == 0


def test_block_removed_removes_every_sub_key():
    idx, ap = make()
    ap.apply(A, BlockStored([101, 102], None, TOKENS[:256], 128))
    ap.apply(A, BlockRemoved([102]))
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 8
    assert idx.stats().num_keys == 8
    ap.apply(A, BlockRemoved([101, 999]))
    assert match_prefix(idx, hasher(), TOKENS).pods == {}
    assert idx.stats().num_keys == 0
    assert ap.num_blocks(A) == 0
    assert ap.stats.num_blocks_removed == 2
    assert ap.stats.num_unknown_hashes == 1


def test_medium_bits_of_expanded_blocks():
    idx, ap = make()
    ap.apply(A, BlockStored([101, 102], None, TOKENS[:256], 128))
    ap.apply(A, BlockStored([101, 102], None, [], 128, medium="CPU"))  # offload tier, no tokens
    assert ap.stats.num_blocks_stored == 4
    ap.apply(A, BlockRemoved([102], medium="GPU"))
    m = match_prefix(idx, hasher(), TOKENS)
    assert m.pods[A].blocks_by_tier == {Medium.GPU: 8, Medium.CPU: 8}
    keys = hasher().hash_blocks(TOKENS[:256])
    assert idx.lookup(keys)[8:] == [{A: medium_set(Medium.CPU)}] * 8
    ap.apply(A, BlockRemoved([101, 102], medium="CPU"))
    assert match_prefix(idx, hasher(), TOKENS).pods[A].blocks_by_tier == {Medium.GPU: 8}
    assert ap.num_blocks(A) == 1
    assert idx.stats().num_keys == 8
    ap.apply(A, BlockRemoved([101]))
    assert idx.stats().num_keys == 0 and ap.num_blocks(A) == 0


def test_overflow_counts_engine_blocks_and_removes_their_sub_keys():
    idx, ap = make(max_blocks_per_pod=2)
    ap.apply(A, BlockStored([1, 2], None, TOKENS[:256], 128))
    ap.apply(A, BlockStored([3], 2, TOKENS[256:384], 128))
    assert ap.stats.num_overflow == 1
    assert ap.num_blocks(A) == 2
    assert idx.stats().num_keys == 16  # blocks 2 and 3; block 1's 8 sub-keys left with it
    assert match_prefix(idx, hasher(), TOKENS).pods == {}


def test_flush_namespace_removes_expanded_blocks():
    idx, ap = make()
    ap.apply(A, BlockStored([1, 2], None, TOKENS[:256], 128, extra_keys=["acme"]))
    ap.apply(A, BlockStored([3], None, TOKENS[:128], 128))
    assert match_prefix(idx, hasher(tenant="acme"), TOKENS).pods[A].num_blocks == 16
    assert ap.flush_namespace(tenant="acme") == 2
    assert match_prefix(idx, hasher(tenant="acme"), TOKENS).pods == {}
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 8
    assert idx.stats().num_keys == 8


def test_hash_restored_at_router_size_is_tracked_as_one_router_block():
    idx, ap = make()
    ap.apply(A, BlockStored([1], None, TOKENS[:32], 32))
    ap.apply(A, BlockStored([1], None, TOKENS[:16], 16))  # same hash, now one router block
    ap.apply(A, BlockRemoved([1]))
    # hash 1 now names the 16-token key only: its removal takes sub-key 0 (sub-key 1 stays, as
    # the old key of any re-stored hash always did)
    keys = hasher().hash_blocks(TOKENS[:32])
    assert idx.lookup(keys) == []
    assert idx.stats().num_keys == 1
    assert ap.num_blocks(A) == 0


def test_key_memo_is_filled_at_router_granularity():
    memo = BlockKeyMemo(capacity=1000)
    idx, ap = make(memo=memo)
    ap.apply(A, BlockStored([1, 2], None, TOKENS[:256], 128, extra_keys=["acme"]))
    ap.apply(A, BlockStored([3], 2, TOKENS[256:384], 128))
    assert len(memo) == 24
    h = hasher(tenant="acme")
    keys = h.hash_blocks(TOKENS)
    raw = b"".join(t.to_bytes(4, "little") for t in TOKENS)
    assert memo.walk(h.root, raw, 64) == keys[:24]
    assert list(iter_block_keys(h, TOKENS, memo)) == keys
    assert match_prefix(idx, h, TOKENS, memo).pods[A].num_blocks == 24


def test_malformed_expanded_events_are_bad_events():
    idx, ap = make()
    ap.apply(A, BlockStored([1, 2], None, TOKENS[:200], 128))  # 56 tokens short
    ap.apply(A, BlockStored([1], None, [-1, *TOKENS[1:128]], 128))
    ap.apply(A, BlockStored([1], None, TOKENS[:128], -128))
    assert ap.stats.num_bad_events == 3
    assert ap.stats.num_block_size_mismatch == 0
    assert idx.stats().num_keys == 0


# ---------------------------------------------------------------- sizes the router cannot key


def test_block_size_mismatch_is_counted_and_warned_once_per_pod(caplog):
    idx, ap = make(block_size=64)
    caplog.set_level(logging.INFO, logger="kvmesh.router.ingest")
    for i in range(50):
        ap.apply(A, BlockStored([i], None, TOKENS[:16], 16))
    assert ap.stats.num_block_size_mismatch == 50
    assert ap.stats.num_bad_events == 0
    assert idx.stats().num_keys == 0
    assert ap.pod_block_size(A) == 16
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert A in text and "16-token" in text and "64-token" in text
    assert "--block-size 16" in text
    # a malformed event of a mismatched size is still a mismatch, not a second warning
    ap.apply(A, BlockStored([1], None, [], 16))
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_mismatch_fix_divides_every_pods_block_size(caplog):
    idx, ap = make(block_size=32)
    ap.apply(A, BlockStored([1], None, TOKENS[:32], 32))
    for i in range(3):
        ap.apply(B, BlockStored([i], None, TOKENS[:48], 48))
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "48-token" in warning.getMessage() and "--block-size 16" in warning.getMessage()
    assert ap.stats.num_block_size_mismatch == 3
    assert ap.pod_block_sizes() == {A: 32, B: 48}
    assert idx.stats().num_keys == 1
    # another pod with the same size gets its own warning
    ap.apply(C, BlockStored([1], None, TOKENS[:48], 48))
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_block_size_survives_drop_pod_not_forget_pod():
    _, ap = make()
    ap.apply(A, BlockStored([1], None, TOKENS[:128], 128))
    ap.drop_pod(A)
    assert ap.pod_block_size(A) == 128 and ap.num_blocks(A) == 0
    assert ap.pod_stats() == {A: {"block_size": 128, "blocks": 0, "kv_group": None}}
    ap.forget_pod(A)
    assert ap.pod_block_size(A) is None and ap.pod_stats() == {}


# ---------------------------------------------------------------- KV cache groups


def test_non_full_attention_groups_are_skipped():
    idx, ap = make()
    for kind in ("sliding_window", "chunked_local_attention", "mamba", "sliding_window_mla", "unknown"):
        ap.apply(A, stored([1, 2], None, TOKENS[:32], 16, group_idx=0, kind=kind))
    assert ap.stats.num_skipped_groups == 5
    assert idx.stats().num_keys == 0
    for pod, kind in ((A, "full_attention"), (B, "mla_attention"), (C, "sink_full_attention")):
        ap.apply(pod, stored([1, 2], None, TOKENS[:32], 16, group_idx=1, kind=kind))
    m = match_prefix(idx, hasher(), TOKENS)
    assert {p: pm.num_blocks for p, pm in m.pods.items()} == {A: 2, B: 2, C: 2}
    assert ap.pod_kv_group(A) == 1
    # the sliding-window group evicting the same hashes leaves the full-attention blocks alone
    ap.apply(A, BlockRemoved([1, 2], group_idx=0))
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 2
    assert ap.stats.num_skipped_groups == 6
    ap.apply(A, BlockRemoved([2], group_idx=1))
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 1


def test_untagged_kind_with_group_counts_as_full_attention():
    idx, ap = make()
    ap.apply(A, stored([1], None, TOKENS[:16], 16, kind="sliding_window"))  # no group_idx
    ap.apply(A, BlockStored([1], None, TOKENS[:16], 16, group_idx=0))
    assert ap.stats.num_skipped_groups == 1
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 1


def test_two_full_attention_groups_only_the_first_is_indexed():
    idx, ap = make()
    # vLLM announces the same tokens with the same hashes once per group
    ap.apply(A, stored([1, 2], None, TOKENS[:32], 16, group_idx=0, kind="full_attention"))
    ap.apply(A, stored([1, 2], None, TOKENS[:32], 16, group_idx=1, kind="full_attention"))
    ap.apply(A, stored([3], 2, TOKENS[32:48], 16, group_idx=1, kind="full_attention"))
    assert ap.stats.num_skipped_groups == 2
    assert ap.pod_kv_group(A) == 0
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 2
    ap.apply(A, BlockRemoved([1, 2], group_idx=1))  # group 1 evicts: group 0 still holds them
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 2
    ap.apply(A, BlockRemoved([2], group_idx=0))
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 1
    assert ap.stats.num_skipped_groups == 3


def test_a_lower_full_attention_group_seen_later_takes_over():
    idx, ap = make()
    ap.apply(A, stored([1, 2], None, TOKENS[:32], 16, group_idx=2, kind="full_attention"))
    ap.apply(A, stored([5], None, TOKENS[100:116], 16, group_idx=1, kind="full_attention"))
    assert ap.pod_kv_group(A) == 1
    assert ap.num_blocks(A) == 1
    assert match_prefix(idx, hasher(), TOKENS).pods == {}  # group 2's blocks left the index
    ap.apply(A, BlockRemoved([5], group_idx=2))
    assert ap.num_blocks(A) == 1
    # a cleared cache learns its group again
    ap.drop_pod(A)
    assert ap.pod_kv_group(A) is None


def test_untagged_pods_beside_grouped_pods():
    idx, ap = make()
    ap.apply(A, BlockStored([1, 2], None, TOKENS[:32], 16, group_idx=0))
    ap.apply(B, BlockStored([1, 2], None, TOKENS[:32], 16))
    ap.apply(B, BlockRemoved([2]))
    m = match_prefix(idx, hasher(), TOKENS)
    assert {p: pm.num_blocks for p, pm in m.pods.items()} == {A: 2, B: 1}
    ap.apply(A, BlockRemoved([2]))  # untagged removal from a pod indexing group 0: not its group
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 2


def test_grouped_128_token_blocks():
    idx, ap = make()
    ap.apply(A, stored([1, 2], None, TOKENS[:256], 128, group_idx=0, kind="sliding_window"))
    ap.apply(A, stored([1, 2], None, TOKENS[:256], 128, group_idx=1, kind="full_attention"))
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 16
    ap.apply(A, BlockRemoved([2], group_idx=0))
    assert idx.stats().num_keys == 16
    ap.apply(A, BlockRemoved([2], group_idx=1))
    assert idx.stats().num_keys == 8


# ---------------------------------------------------------------- where users see it


def test_metrics_export_ingest_counters_and_pod_block_sizes():
    _, ap = make(block_size=32)
    metrics = RouterMetrics()
    holder: list[EventApplier] = []
    metrics.watch_ingest(lambda: holder[0] if holder else None)
    assert b"kvmesh_router_ingest" not in generate_latest(metrics.registry)
    holder.append(ap)
    ap.apply(A, BlockStored([1], None, TOKENS[:128], 128))
    for i in range(3):
        ap.apply(B, BlockStored([i], None, TOKENS[:48], 48))
    ap.apply(C, stored([1], None, TOKENS[:32], 32, group_idx=0, kind="mamba"))
    text = generate_latest(metrics.registry).decode()
    assert "kvmesh_router_ingest_block_size_mismatch_total 3.0" in text
    assert "kvmesh_router_ingest_skipped_groups_total 1.0" in text
    assert "kvmesh_router_ingest_bad_events_total 0.0" in text
    assert "kvmesh_router_ingest_events_total 5.0" in text
    assert f'kvmesh_router_pod_block_size{{endpoint="{A}"}} 128.0' in text
    assert f'kvmesh_router_pod_block_size{{endpoint="{B}"}} 48.0' in text
    assert f'kvmesh_router_pod_indexed_blocks{{endpoint="{A}"}} 1.0' in text


async def test_gateway_admin_index_and_metrics_show_pod_block_sizes():
    config = router_config_from_dict({"model": MODEL, "adminToken": "t", "blockSize": 16})
    gw = Gateway(config)
    client = TestClient(TestServer(gw.app))
    await client.start_server()
    try:
        assert gw.applier is not None
        gw.applier.apply(A, BlockStored([1], None, TOKENS[:128], 128))
        gw.applier.apply(B, BlockStored([1], None, TOKENS[:24], 24))
        body = msgspec.json.decode(
            await (await client.get("/admin/index", headers={"Authorization": "Bearer t"})).read()
        )
        assert body["block_size"] == 16
        assert body["pods"][A] == {"block_size": 128, "blocks": 1, "kv_group": None}
        assert body["pods"][B]["block_size"] == 24
        assert body["ingest"]["num_block_size_mismatch"] == 1
        assert body["ingest"]["num_skipped_groups"] == 0
        text = await (await client.get("/metrics")).text()
        assert f'kvmesh_router_pod_block_size{{endpoint="{A}"}} 128.0' in text
        assert "kvmesh_router_ingest_block_size_mismatch_total 1.0" in text
    finally:
        await client.close()


# ---------------------------------------------------------------- property


def _engine_hash(prefix: list[int]) -> bytes:
    return hashlib.blake2b(repr(prefix).encode(), digest_size=8).digest()


def _publish(held: set[tuple[int, ...]], prompt: list[int], size: int) -> list[BlockStored]:
    """What an engine with ``size``-token blocks announces after serving ``prompt``."""
    n = len(prompt) // size
    first = 0
    while first < n and tuple(prompt[: (first + 1) * size]) in held:
        first += 1
    if first == n:
        return []
    for i in range(first, n):
        held.add(tuple(prompt[: (i + 1) * size]))
    return [
        BlockStored(
            [_engine_hash(prompt[: (i + 1) * size]) for i in range(first, n)],
            _engine_hash(prompt[: first * size]) if first else None,
            prompt[first * size : n * size],
            size,
        )
    ]


_prompt = st.lists(st.integers(0, 2), min_size=0, max_size=48)


@settings(max_examples=150, deadline=None)
@given(
    router_bs=st.integers(1, 4),
    k=st.integers(1, 6),
    stems=st.lists(_prompt, min_size=1, max_size=3),
    served=st.lists(st.tuples(st.integers(0, 2), _prompt), min_size=1, max_size=8),
    queries=st.lists(st.tuples(st.integers(0, 2), _prompt), min_size=1, max_size=8),
)
def test_engine_blocks_match_like_router_blocks_truncated_to_engine_blocks(
    router_bs, k, stems, served, queries
):
    """Chains indexed from B = k·b engine blocks match any prompt like the same chains indexed
    from b-token blocks, truncated to a multiple of B."""
    engine_bs = k * router_bs
    big_idx, big = make(block_size=router_bs)
    small_idx, small = make(block_size=router_bs)
    held_big: set[tuple[int, ...]] = set()
    held_small: set[tuple[int, ...]] = set()
    for stem, tail in served:
        prompt = stems[stem % len(stems)] + tail
        for ev in _publish(held_big, prompt, engine_bs):
            big.apply(A, ev)
        for ev in _publish(held_small, prompt, router_bs):
            small.apply(A, ev)
    assert big.stats.num_bad_events == big.stats.num_orphans == 0
    h = hasher(router_bs)
    prompts = [stems[s % len(stems)] + t for s, t in (*served, *queries)]
    for prompt in prompts + [p[:cut] for p in prompts for cut in (len(p) // 2, len(p) - 1)]:
        at_small = match_prefix(small_idx, h, prompt).hit_tokens(A)
        raw = match_prefix(big_idx, h, prompt)
        assert raw.hit_tokens(A) >= at_small - at_small % engine_bs
        assert big.align_match(raw).hit_tokens(A) == at_small - at_small % engine_bs, prompt


def test_scheduler_credits_only_whole_engine_blocks_once_the_gateway_wires_the_applier():
    idx, ap = make()
    ap.apply(A, stored([1, 2], None, TOKENS[:256], 128))
    scheduler = Scheduler.from_config(load_scheduler_config("precise"), index=idx)
    prompt = TOKENS[:200] + [7] * 100  # leaves the cached prefix inside the second 128-token block
    request = RoutingRequest("r0", prompt, ap.namespace())
    assert scheduler.match(request).hit_tokens(A) == 192  # sub-keys up to where the prompt diverges
    scheduler.align_match = ap.align_match
    assert scheduler.match(request).hit_tokens(A) == 128  # what vLLM can really reuse
