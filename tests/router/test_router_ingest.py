"""EventApplier: events re-hashed into kvmesh keys, engine hashes kept as opaque ids."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvmesh.core.hashing import BlockHasher, Namespace
from kvmesh.core.types import Medium, PodId
from kvmesh.core.vllm_hashing import vllm_block_hashes
from kvmesh.router.index import InMemoryIndex, medium_set
from kvmesh.router.ingest import EventApplier
from kvmesh.router.prefix import iter_block_keys, match_prefix

MODEL = "m"
A, B = PodId("http://a:1"), PodId("http://b:1")
TOKENS = list(range(1000, 1000 + 16 * 6))


def make(capacity: int = 10_000, per_pod: int = 10_000) -> tuple[InMemoryIndex, EventApplier]:
    idx = InMemoryIndex(capacity)
    return idx, EventApplier(idx, model=MODEL, max_blocks_per_pod=per_pod)


def hasher(tenant: str = "", lora: str = "") -> BlockHasher:
    return BlockHasher(Namespace(MODEL, lora=lora, tenant=tenant), 16)


def test_stored_blocks_are_keyed_like_requests():
    idx, ap = make()
    ap.apply(A, BlockStored([11, 12, 13, 14], None, TOKENS[:64], 16))
    m = match_prefix(idx, hasher(), TOKENS)
    assert m.num_blocks == 6
    assert m.pods[A].num_blocks == 4
    assert m.hit_tokens(A) == 64
    assert ap.stats.num_blocks_stored == 4


def test_chain_continues_from_parent_engine_hash():
    idx, ap = make()
    ap.apply(A, BlockStored([11, 12], None, TOKENS[:32], 16))
    ap.apply(A, BlockStored([13, 14, 15], 12, TOKENS[32:80], 16))
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 5
    # engine hashes are opaque: bytes work the same as ints
    ap.apply(B, BlockStored([b"x1", b"x2"], None, TOKENS[:32], 16))
    ap.apply(B, BlockStored([b"x3"], b"x2", TOKENS[32:48], 16))
    assert match_prefix(idx, hasher(), TOKENS).pods[B].num_blocks == 3


def test_unknown_parent_is_an_orphan_and_skipped():
    idx, ap = make()
    ap.apply(A, BlockStored([13], 999, TOKENS[32:48], 16))
    assert ap.stats.num_orphans == 1
    assert idx.stats().num_keys == 0


def test_tenant_from_extra_keys_flat_and_per_block_forms():
    idx, ap = make()
    ap.apply(A, BlockStored([1, 2], None, TOKENS[:32], 16, extra_keys=["acme"]))
    ap.apply(B, BlockStored([1, 2], None, TOKENS[:32], 16, extra_keys=[["globex"], None]))
    assert set(match_prefix(idx, hasher("acme"), TOKENS).pods) == {A}
    assert set(match_prefix(idx, hasher("globex"), TOKENS).pods) == {B}
    assert match_prefix(idx, hasher(), TOKENS).pods == {}
    # a continued chain inherits the tenant of its parent
    ap.apply(A, BlockStored([3], 2, TOKENS[32:48], 16))
    assert match_prefix(idx, hasher("acme"), TOKENS).pods[A].num_blocks == 3


def test_lora_name_and_salt_from_vllm_style_event():
    idx, ap = make()
    ap.apply(
        A, BlockStored([1, 2], None, TOKENS[:32], 16, lora_name="sql", extra_keys=[["sql", "t1"], ["sql"]])
    )
    assert match_prefix(idx, hasher("t1", lora="sql"), TOKENS).pods[A].num_blocks == 2
    assert match_prefix(idx, hasher("t1"), TOKENS).pods == {}


def test_vllm_pod_hashes_are_only_ids():
    """A real vLLM pod publishes its own sha256-cbor hashes; routing still works by re-hashing."""
    idx, ap = make()
    vh = vllm_block_hashes(TOKENS[:48], 16)
    ap.apply(A, BlockStored(vh, None, TOKENS[:48], 16))
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 3
    ap.apply(A, BlockRemoved(vh[2:]))
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 2


def test_offload_tier_events_without_tokens_add_a_tier():
    idx, ap = make()
    ap.apply(A, BlockStored([1, 2, 3], None, TOKENS[:48], 16))
    ap.apply(A, BlockStored([1, 2], None, [], 16, medium="CPU"))
    ap.apply(A, BlockStored([77], None, [], 16, medium="CPU"))
    assert ap.stats.num_unknown_hashes == 1
    ap.apply(A, BlockRemoved([1, 2, 3], medium="GPU"))
    m = match_prefix(idx, hasher(), TOKENS)
    assert m.pods[A].num_blocks == 2
    assert m.pods[A].blocks_by_tier == {Medium.CPU: 2}
    ap.apply(A, BlockRemoved([1], medium="CPU"))
    assert match_prefix(idx, hasher(), TOKENS).pods == {}
    assert ap.num_blocks(A) == 1  # hash 2 still held on CPU


def test_removed_unknown_hashes_are_counted():
    _, ap = make()
    ap.apply(A, BlockRemoved([5, 6]))
    assert ap.stats.num_unknown_hashes == 2


def test_all_blocks_cleared_drops_only_that_pod():
    idx, ap = make()
    ap.apply_batch(A, KVEventBatch(0.0, [BlockStored([1, 2], None, TOKENS[:32], 16)]))
    ap.apply_batch(B, KVEventBatch(0.0, [BlockStored([1, 2], None, TOKENS[:32], 16)]))
    ap.apply(A, AllBlocksCleared())
    assert set(match_prefix(idx, hasher(), TOKENS).pods) == {B}
    assert ap.num_blocks(A) == 0
    # hashes of a cleared pod no longer continue chains
    ap.apply(A, BlockStored([3], 2, TOKENS[32:48], 16))
    assert ap.stats.num_orphans == 1


def test_block_size_mismatch_and_short_tokens_are_counted_apart():
    idx, ap = make()
    ap.apply(A, BlockStored([1], None, TOKENS[:24], 24))  # 24 is not a multiple of 16
    ap.apply(A, BlockStored([1, 2], None, TOKENS[:20], 16))
    ap.apply(A, BlockStored([1], None, TOKENS[:16], 32))  # a multiple, but 16 tokens short
    ap.apply(A, BlockStored([1], None, TOKENS[:16], 0))
    assert ap.stats.num_block_size_mismatch == 1
    assert ap.stats.num_bad_events == 3
    assert idx.stats().num_keys == 0


def test_per_pod_overflow_removes_oldest_from_index():
    idx, ap = make(per_pod=4)
    ap.apply(A, BlockStored([1, 2, 3], None, TOKENS[:48], 16))
    ap.apply(A, BlockStored([4, 5], 3, TOKENS[48:80], 16))
    assert ap.num_blocks(A) == 4
    assert ap.stats.num_overflow == 1
    # block 0 left, so A no longer holds the prefix from the start
    assert match_prefix(idx, hasher(), TOKENS).pods == {}
    assert idx.stats().num_entries == 4


def test_flush_namespace_by_tenant():
    idx, ap = make()
    ap.apply(A, BlockStored([1, 2], None, TOKENS[:32], 16, extra_keys=["acme"]))
    ap.apply(A, BlockStored([3, 4], None, TOKENS[:32], 16))
    assert ap.flush_namespace(tenant="acme") == 2
    assert match_prefix(idx, hasher("acme"), TOKENS).pods == {}
    assert match_prefix(idx, hasher(), TOKENS).pods[A].num_blocks == 2


def test_multi_tier_match_and_index_media():
    idx, ap = make()
    ap.apply(A, BlockStored([1, 2, 3], None, TOKENS[:48], 16, medium="CPU"))
    ap.apply(A, BlockStored([1], None, [], 16, medium="GPU"))
    m = match_prefix(idx, hasher(), TOKENS)
    assert m.pods[A].blocks_by_tier == {Medium.GPU: 1, Medium.CPU: 2}
    keys = list(iter_block_keys(hasher(), TOKENS))
    assert idx.lookup(keys[:1]) == [{A: medium_set(Medium.GPU, Medium.CPU)}]


def test_match_prefix_requires_consecutive_blocks_per_pod():
    idx, _ = make()
    keys = list(iter_block_keys(hasher(), TOKENS))
    assert keys == hasher().hash_blocks(TOKENS)
    idx.add(keys[:4], A, medium_set(Medium.GPU))
    idx.add(keys[:1], B, medium_set(Medium.GPU))
    idx.add(keys[2:4], B, medium_set(Medium.GPU))  # B misses block 1
    m = match_prefix(idx, hasher(), TOKENS)
    assert m.pods[A].num_blocks == 4
    assert m.pods[B].num_blocks == 1


def test_out_of_range_token_ids_are_bad_events():
    idx, ap = make()
    ap.apply(A, BlockStored([1], None, [-1, *TOKENS[1:16]], 16))
    ap.apply(A, BlockStored([2], None, [2**32, *TOKENS[1:16]], 16))
    assert ap.stats.num_bad_events == 2
    assert idx.stats().num_keys == 0


def test_key_memo_matches_the_hasher_and_is_filled_from_events():
    from kvmesh.router.keymemo import BlockKeyMemo

    memo = BlockKeyMemo(capacity=100)
    idx = InMemoryIndex()
    ap = EventApplier(idx, model=MODEL, memo=memo)
    ap.apply(A, BlockStored([1, 2], None, TOKENS[:32], 16, extra_keys=["acme"]))
    ap.apply(A, BlockStored([3], 2, TOKENS[32:48], 16))
    assert len(memo) == 3
    h = hasher("acme")
    # memo hits for 3 blocks, then hashing takes over mid-chain
    assert list(iter_block_keys(h, TOKENS, memo)) == h.hash_blocks(TOKENS)
    # another namespace never hits the tenant's entries
    assert list(iter_block_keys(hasher(), TOKENS, memo)) == hasher().hash_blocks(TOKENS)
    assert match_prefix(idx, h, TOKENS, memo).pods[A].num_blocks == 3


def test_key_memo_is_bounded_oldest_first():
    from kvmesh.router.keymemo import BlockKeyMemo

    memo = BlockKeyMemo(capacity=4)
    h = hasher()
    keys = h.hash_blocks(TOKENS)
    raw = b"".join(t.to_bytes(4, "little") for t in TOKENS)
    memo.remember(h.root, raw, keys)
    assert len(memo) == 4 and memo.num_evicted == 2
    assert memo.get(h.root + raw[:64]) is None  # block 0 left first
    assert memo.get(keys[4] + raw[5 * 64 : 6 * 64]) == keys[5]
    # with block 0 gone, matching falls back to hashing and still gives the right keys
    assert list(iter_block_keys(h, TOKENS, memo)) == keys


class _ModelEngine:
    """A minimal engine cache for property tests: publishes what a kvmesh engine would."""

    def __init__(self) -> None:
        self.held: dict = {}  # our key -> engine hash

    def serve(self, tokens: list[int], tenant: str) -> list:
        keys = hasher(tenant).hash_blocks(tokens)
        hit = 0
        while hit < len(keys) and keys[hit] in self.held:
            hit += 1
        new = keys[hit:]
        events = []
        if new:
            hashes = [int.from_bytes(k[:8], "big") for k in new]
            parent = self.held[keys[hit - 1]] if hit else None
            events.append(
                BlockStored(
                    hashes,
                    parent,
                    tokens[hit * 16 : len(keys) * 16],
                    16,
                    extra_keys=[[tenant]] if tenant and not hit else None,
                )
            )
            self.held.update(zip(new, hashes, strict=True))
        return events

    def evict_tail(self, tokens: list[int], tenant: str, n: int) -> list:
        keys = [k for k in hasher(tenant).hash_blocks(tokens) if k in self.held]
        gone = keys[len(keys) - n :] if n else []
        for k in gone:
            del self.held[k]
        return [BlockRemoved([int.from_bytes(k[:8], "big") for k in gone])] if gone else []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.sampled_from(["", "t1"]), st.booleans(), st.integers(0, 3)),
        min_size=1,
        max_size=25,
    )
)
def test_index_tracks_an_engine_cache_exactly(steps):
    """Random serve/evict sequences: the index answers what the engine holds, block for block."""
    prompts = {i: [7] * 16 * (i % 2) + list(range(100 * i, 100 * i + 16 * (2 + i))) for i in range(5)}
    idx, ap = make()
    engine = _ModelEngine()
    for prompt_id, tenant, evict, n in steps:
        tokens = prompts[prompt_id]
        events = engine.evict_tail(tokens, tenant, n) if evict else engine.serve(tokens, tenant)
        for ev in events:
            ap.apply(A, ev)
        for pid, toks in prompts.items():
            for t in ("", "t1"):
                expected = 0
                for k in hasher(t).hash_blocks(toks):
                    if k not in engine.held:
                        break
                    expected += 1
                assert match_prefix(idx, hasher(t), toks).hit_tokens(A) == expected * 16, (pid, t)
