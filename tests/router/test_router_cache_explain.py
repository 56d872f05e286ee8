"""The pure parts of cache reporting: engine figures, the memories, the reason order, the ledger."""

from __future__ import annotations

import pytest

from kvmesh.core.cache_usage import CacheUsage
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.router.cache_explain import MissFacts, MissReason, explain_miss
from kvmesh.router.cache_memory import SeenBlocks, TextPrints, prompt_texts, text_prints
from kvmesh.router.index import MEDIUM_BITS, MediumSet
from kvmesh.router.types import Decision, PodMatch, PrefixMatch, ScoreTerms
from kvmesh.router.usage import OTHER_TENANTS, UsageLedger

A, B = PodId("http://a:1"), PodId("http://b:1")
GPU, SHARED = MediumSet(MEDIUM_BITS[Medium.GPU]), MediumSet(MEDIUM_BITS[Medium.SHARED])


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "big"))


def test_engine_figures_round_trip_through_header_and_usage():
    usage = CacheUsage(96, 120, {"GPU": 64, "SHARED": 32}, store_fault=True)
    assert usage.header_value() == "cached=96;prompt=120;tiers=GPU:64,SHARED:32;store_fault=1"
    assert CacheUsage.from_header(usage.header_value()) == usage
    body = {"prompt_tokens": 120, "prompt_tokens_details": usage.usage_details()}
    assert CacheUsage.from_usage(body) == usage
    assert CacheUsage.from_usage({"prompt_tokens": 5, "prompt_tokens_details": None}) is None
    assert CacheUsage.from_usage({"prompt_tokens_details": {"cached_tokens": 3}}) == CacheUsage(3)
    for bad in (None, "", "cached=x", "prompt=3", "cached=-1"):
        assert CacheUsage.from_header(bad) is None


def test_seen_blocks_keep_the_latest_add_and_removal_apart_and_stay_bounded():
    now = [10.0]
    seen = SeenBlocks(64, clock=lambda: now[0])
    seen.note_added([key(1), key(2)], GPU)
    now[0] = 20.0
    seen.note_removed([key(1)], GPU)
    now[0] = 30.0
    seen.note_added([key(1)], SHARED)  # recomputed after its eviction: the removal stays
    first = seen.get(key(1))
    assert first is not None and (first.added_at, first.removed_at, first.tier) == (30.0, 20.0, Medium.GPU)
    assert first.seen_before(25.0) and not first.seen_before(5.0)
    second = seen.get(key(2))
    assert second is not None and second.removed_at == 0 and second.tier is Medium.GPU
    assert second.seen_before(11.0) and not second.seen_before(10.0)
    seen.note_added([key(i) for i in range(100, 200)], GPU)
    assert seen.get(key(2)) is None and seen.get(key(199)) is not None
    assert seen.get(key(1)) is not None  # its removal is still remembered
    off = SeenBlocks(0)
    off.note_added([key(1)], GPU)
    assert off.get(key(1)) is None


def test_text_prints_are_per_namespace_and_notice_another_first_block():
    text = "x" * 700
    prints_a, prints_b = text_prints(b"tenant-a", [text]), text_prints(b"tenant-b", [text])
    assert len(prints_a) == 3  # 256, 512 and all 700 bytes
    assert not set(prints_a) & set(prints_b)
    assert text_prints(b"tenant-a", ["short"]) == []
    memory = TextPrints(100)
    memory.remember(prints_a, key(1))
    assert memory.tokenized_otherwise(prints_a, key(2))
    assert not memory.tokenized_otherwise(prints_a, key(1))
    assert not memory.tokenized_otherwise(prints_b, key(2))
    # a longer text sharing the first 512 bytes is compared at the longest shared print
    assert memory.tokenized_otherwise(text_prints(b"tenant-a", [text + "y" * 400]), key(2))


def test_prompt_texts_read_prompts_and_chat_contents():
    assert prompt_texts({"prompt": "hi"}, chat=False) == ["hi"]
    assert prompt_texts({"prompt": ["hi"]}, chat=False) == ["hi"]
    assert prompt_texts({"prompt": [1, 2]}, chat=False) == []
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "u"}, {"type": "image_url"}]},
    ]
    assert prompt_texts({"messages": messages}, chat=True) == ["s", "u"]


def facts(cached: int, prompt: int = 160, *, prefix: PrefixMatch | None = None, **kw: object) -> MissFacts:
    decision = Decision(A, [A, B], {A: 0.6, B: 0.4})
    base = {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "pod": A,
        "router_block_size": 16,
        "engine_block_size": 16,
        "prefix": prefix,
        "decision": decision,
    }
    base.update(kw)
    return MissFacts(**base)  # type: ignore[arg-type]


def explain(f: MissFacts, *, seen: SeenBlocks | None = None, retokenized: bool = False) -> MissReason:
    return explain_miss(
        f,
        seen=seen or SeenBlocks(16),
        key_at=lambda i: key(i),
        tokenized_otherwise=lambda: retokenized,
        now=100.0,
        routed_at=50.0,
    ).reason


def test_reasons_in_order():
    assert explain(facts(160)) is MissReason.NONE
    # the block holding the last token is never served, aligned or not
    assert explain(facts(144)) is MissReason.PARTIAL_BLOCK
    assert explain(facts(144, 150)) is MissReason.PARTIAL_BLOCK
    assert explain(facts(128, 150, engine_block_size=32)) is MissReason.PARTIAL_BLOCK
    assert explain(facts(128, 150, engine_block_size=24)) is MissReason.BLOCK_SIZE_MISMATCH
    assert explain(facts(0)) is MissReason.COLD
    assert explain(facts(0), retokenized=True) is MissReason.TOKENIZATION_DIFFERS
    seen = SeenBlocks(16, clock=lambda: 10.0)
    seen.note_added([key(2)], GPU)
    assert explain(facts(32), seen=seen) is MissReason.EVICTED
    late = SeenBlocks(16, clock=lambda: 60.0)  # first seen after the request was routed: its own
    late.note_added([key(2)], GPU)
    assert explain(facts(32), seen=late) is MissReason.COLD
    predicted = PrefixMatch(10, 16, {A: PodMatch(4, {Medium.GPU: 2, Medium.SHARED: 2})})
    assert explain(facts(32, prefix=predicted)) is MissReason.EVICTED
    assert explain(facts(32, prefix=predicted, store_fault=True)) is MissReason.STORE_FAULT
    elsewhere = PrefixMatch(10, 16, {A: PodMatch(2, {Medium.GPU: 2}), B: PodMatch(6, {Medium.GPU: 6})})
    assert explain(facts(0, prefix=elsewhere, store_fault=True)) is MissReason.ROUTED_FOR_LOAD


def test_routed_for_load_details_and_store_fault_tier():
    terms = ScoreTerms([A, B], ["prefix", "queue"], [1.0, 3.0], [[0.0, 1.0], [1.0, 0.0]])
    decision = Decision(A, [A, B], {A: 0.75, B: 0.25}, terms=terms)
    prefix = PrefixMatch(10, 16, {B: PodMatch(6, {Medium.GPU: 6})})
    verdict = explain_miss(
        facts(0, prefix=prefix, decision=decision),
        seen=SeenBlocks(0),
        key_at=key,
        tokenized_otherwise=lambda: False,
        now=1.0,
        routed_at=1.0,
    )
    assert verdict.header_value() == (
        "cached=0;prompt=160;reason=routed_for_load;by=96;score=0.750;holder_score=0.250;"
        "terms=queue:+0.750,prefix:-0.250"
    )
    # a holder the filters left out (unhealthy, saturated) is named as such
    filtered = PrefixMatch(10, 16, {PodId("http://c:1"): PodMatch(3, {Medium.GPU: 3})})
    verdict = explain_miss(
        facts(0, prefix=filtered),
        seen=SeenBlocks(0),
        key_at=key,
        tokenized_otherwise=lambda: False,
        now=1.0,
        routed_at=1.0,
    )
    assert verdict.header_value() == "cached=0;prompt=160;reason=routed_for_load;by=48;holder=filtered"
    shared = PrefixMatch(10, 16, {A: PodMatch(5, {Medium.GPU: 1, Medium.SHARED: 4})})
    verdict = explain_miss(
        facts(16, prefix=shared, store_fault=True, predicted=False),
        seen=SeenBlocks(0),
        key_at=key,
        tokenized_otherwise=lambda: False,
        now=1.0,
        routed_at=1.0,
    )
    assert verdict.reason is MissReason.STORE_FAULT and verdict.details == {"tier": "SHARED"}


def test_usage_ledger_bounds_its_tenants():
    ledger = UsageLedger(max_tenants=1)
    ledger.add_request("a", prompt_tokens=100, cached_tokens=64, cached_by_tier={"GPU": 48})
    ledger.add_request("b", prompt_tokens=10, cached_tokens=None)
    ledger.add_request(OTHER_TENANTS, prompt_tokens=5, cached_tokens=0)
    ledger.add_prewarmed("c", 7)
    a = ledger.get("a")
    assert (a.prompt_tokens, a.cached_tokens, a.cached_by_tier) == (100, 64, {"GPU": 48, "unknown": 16})
    other = ledger.get(OTHER_TENANTS)
    assert (other.requests, other.prompt_tokens, other.unreported_requests, other.prewarmed_tokens) == (
        2,
        15,
        1,
        7,
    )
    assert set(ledger.snapshot()) == {"a", OTHER_TENANTS}
    with pytest.raises(ValueError, match="prewarmed"):
        ledger.add_prewarmed("a", -1)
