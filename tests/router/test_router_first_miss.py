"""Long prompts tokenized until their first block no cache holds: the ids, keys and match equal
those of a full encode on the real SmolLM2 tokenizer."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.agent_apis import PromptApi
from kvmesh.core.hashing import HashAlgo, Namespace, as_token_array
from kvmesh.core.pins import PIN_TTL_HEADER
from kvmesh.core.tokens import Tokenizer
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.errors import TierUnavailableError
from kvmesh.router.first_miss import (
    LongPrompt,
    long_prompt,
    next_cut,
    tokenize_until_miss,
    whole_prompt_needed,
)
from kvmesh.router.index import SHARED_TIER_HOLDER, Holders, InMemoryIndex, medium_set
from kvmesh.router.request_parser import RequestParser
from kvmesh.router.scheduler import Scheduler, load_scheduler_config
from kvmesh.router.tokenize import CachedTokenizer
from kvmesh.router.types import PrefixMatch, RoutingRequest

POD_A, POD_B = PodId("http://a:1"), PodId("http://b:1")
NAMESPACE = Namespace("smollm2")
_TOKENIZER: list[CachedTokenizer] = []


@pytest.fixture(scope="module")
def tokenizer() -> CachedTokenizer:
    if not _TOKENIZER:
        _TOKENIZER.append(CachedTokenizer(Tokenizer.load("smollm2")))
    return _TOKENIZER[0]


def scheduler(index: InMemoryIndex | None) -> Scheduler:
    return Scheduler.from_config(
        load_scheduler_config("precise"), index=index, block_size=16, hash_algo=HashAlgo.XXH3
    )


def hold(sched: Scheduler, ids: list[int], num_blocks: int, pod: PodId, medium: Medium = Medium.GPU) -> None:
    keys = sched.hasher(NAMESPACE).hash_blocks(as_token_array(ids))[:num_blocks]
    assert sched.index is not None
    sched.index.add(keys, pod, medium_set(medium))


def summary(match: PrefixMatch) -> tuple[dict[PodId, tuple[int, dict[Medium, int]]], int | None]:
    pods = {pod: (m.num_blocks, m.blocks_by_tier) for pod, m in match.pods.items()}
    return pods, None if match.shared is None else match.shared.num_blocks


def route(
    sched: Scheduler, tok: CachedTokenizer, text: str, *, special: bool = True, first: int = 8192
) -> tuple[RoutingRequest, PrefixMatch]:
    routing = RoutingRequest("r", as_token_array([]), NAMESPACE)
    found = asyncio.run(
        tokenize_until_miss(
            LongPrompt(text, special, tok), routing, sched, off_loop=False, first_piece_chars=first
        )
    )
    return routing, found


_WORDS = st.sampled_from(
    [
        *[
            "the",
            "river",
            " ",
            "  ",
            "\n",
            "\n\n",
            "\t",
            "é",
            "日本語",
            "🙂",
            "'s",
            "42",
            "!?",
            "x" * 9,
            ".",
            ",",
        ],
        *["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\u00a0", "\r\n", "'ll", "-->"],
    ]
)
TEXTS = st.lists(_WORDS, min_size=1, max_size=160).map(" ".join) | st.text(min_size=1, max_size=400)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS, first=st.integers(1, 64), held=st.integers(0, 40), special=st.booleans())
def test_ids_keys_and_match_equal_a_full_encode(tokenizer, text, first, held, special):
    full = tokenizer.encode_piece(text, special)
    sched = scheduler(InMemoryIndex())
    hold(sched, full, held, POD_A)
    routing, found = route(sched, tokenizer, text, special=special, first=first)
    got = [int(t) for t in routing.tokens]
    assert got == full[: len(got)]
    whole = RoutingRequest("w", as_token_array(full), NAMESPACE)
    want = sched.match(whole)
    assert summary(found) == summary(want)
    if routing.num_prompt_tokens is None:
        assert got == full
    else:
        # stopped at the first block nobody holds, which it tokenized
        assert (want.longest_blocks() + 1) * 16 <= len(got) < len(full)


def test_cuts_are_valid_boundaries_or_the_end():
    text = "ab  cd\u00a0ef gh! ij"
    assert next_cut(text, 0, 100) == len(text)
    assert next_cut(text, 0, 14) == 13  # the space after "!"
    assert next_cut(text, 0, 12) == 9  # after "f"; the no-break space is no cut
    assert next_cut(text, 0, 8) == 2
    assert next_cut(text, 2, 8) == len(text)  # the space at 3 follows a space
    assert next_cut("x" * 50, 0, 20) == 50  # no space: the rest is one piece


def long_document(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = ["river", "mountain", "weather", "stone", "valley", "rain", "über", "42", "north,", "sea."]
    return " ".join(words[i] for i in rng.integers(0, len(words), n_words))


def test_smollm2_long_prompt_stops_at_the_first_miss(tokenizer):
    system = long_document(30_000, 1)  # ~40k tokens
    text = system + " Question: " + long_document(40_000, 2)  # ~95k tokens
    full = tokenizer.encode_piece(text, True)
    assert len(full) > 80_000
    sched = scheduler(InMemoryIndex())
    shared_prefix = len(tokenizer.encode_piece(system, True)) // 16
    hold(sched, full, shared_prefix - 3, POD_A)
    hold(sched, full, 100, POD_B, Medium.CPU)
    hold(sched, full, 50, SHARED_TIER_HOLDER, Medium.SHARED)
    routing, found = route(sched, tokenizer, text)
    want = sched.match(RoutingRequest("w", as_token_array(full), NAMESPACE))
    assert summary(found) == summary(want)
    assert found.pods[POD_A].num_blocks == shared_prefix - 3
    assert found.pods[POD_B].blocks_by_tier == {Medium.CPU: 100}
    got = [int(t) for t in routing.tokens]
    assert got == full[: len(got)]
    assert len(got) < 0.7 * len(full)  # the new question was never tokenized
    # the rest is counted from its characters, close to the real length
    assert routing.num_prompt_tokens is not None
    assert abs(routing.num_prompt_tokens - len(full)) < 0.03 * len(full)
    assert abs(found.num_blocks - len(full) // 16) < 0.03 * len(full) / 16
    # the next prompt with the same start begins inside the held part, and is as exact
    reused = tokenizer.prefixes.num_reused
    other = system + " Another question: " + long_document(40_000, 8)
    routing, found = route(sched, tokenizer, other)
    other_full = tokenizer.encode_piece(other, True)
    assert tokenizer.prefixes.num_reused == reused + 1
    assert summary(found) == summary(sched.match(RoutingRequest("o", as_token_array(other_full), NAMESPACE)))
    got = [int(t) for t in routing.tokens]
    assert got == other_full[: len(got)]
    # a novel prompt stops after its first piece
    routing, found = route(sched, tokenizer, long_document(70_000, 3))
    assert found.pods == {} and len(routing.tokens) < 4096


def test_the_scheduler_counts_the_estimated_length_on_a_match_again(tokenizer):
    sched = scheduler(InMemoryIndex())
    text = long_document(20_000, 4)
    routing, found = route(sched, tokenizer, text)
    assert routing.num_prompt_tokens is not None
    routing.prefix = None
    again = sched.match(routing)
    assert again.num_blocks == found.num_blocks == routing.num_prompt_tokens // 16


def test_without_an_index_the_first_piece_is_all(tokenizer):
    routing, found = route(scheduler(None), tokenizer, long_document(20_000, 5))
    assert found.pods == {} and found.num_blocks > 1000
    assert len(routing.tokens) < 4096


def test_parser_leaves_long_prompts_only_where_asked(tokenizer):
    parser = RequestParser(tokenizer, tokenize_thread_min_chars=8192, first_miss_min_chars=1000)
    text = long_document(400, 6)
    body = f'{{"model": "m", "prompt": "{text}"}}'.encode()

    async def parse(raw: bytes, headers: dict[str, str], api: PromptApi, until: bool):
        return await parser.parse(
            raw, headers, chat=False, model=None, revision=None, api=api, until_first_miss=until
        )

    left = asyncio.run(parse(body, {}, PromptApi.COMPLETIONS, True))
    assert left.long_prompt is not None and left.long_prompt.text == text and len(left.routing.tokens) == 0
    whole = asyncio.run(parse(body, {}, PromptApi.COMPLETIONS, False))
    assert whole.long_prompt is None and len(whole.routing.tokens) > 300
    pinned = asyncio.run(parse(body, {PIN_TTL_HEADER: "60"}, PromptApi.COMPLETIONS, True))
    assert pinned.long_prompt is None and pinned.pin_ttl_s == 60
    chat = f'{{"model": "m", "messages": [{{"role": "user", "content": "{text}"}}]}}'.encode()
    left = asyncio.run(parse(chat, {}, PromptApi.CHAT, True))
    assert left.long_prompt is not None
    assert tokenizer.encode_piece(left.long_prompt.text, False) == tokenizer.apply_chat_template(
        [{"role": "user", "content": text}]
    )
    short = f'{{"model": "m", "prompt": "{text[:500]}"}}'.encode()
    assert asyncio.run(parse(short, {}, PromptApi.COMPLETIONS, True)).long_prompt is None


class _WordTokenizer:
    """A tokenizer without a fast backend: nothing says its pieces compose."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> list[int]:
        return [len(m["content"]) for m in messages]


def test_long_prompt_refuses_tokenizers_that_do_not_compose(tokenizer):
    body = {"prompt": long_document(400, 7)}
    assert long_prompt(tokenizer, PromptApi.COMPLETIONS, body, min_chars=100) is not None
    assert long_prompt(CachedTokenizer(_WordTokenizer()), PromptApi.COMPLETIONS, body, min_chars=100) is None
    assert long_prompt(_WordTokenizer(), PromptApi.COMPLETIONS, body, min_chars=100) is None


def test_history_scorers_need_the_whole_prompt():
    assert not whole_prompt_needed(scheduler(None))
    approximate = Scheduler.from_config(load_scheduler_config("approximate"))
    assert whole_prompt_needed(approximate)


async def test_gateway_routes_a_long_text_prompt_to_the_holder_of_its_start(engines, tokenizer):
    from aiohttp.test_utils import TestClient, TestServer
    from router_fakes import MODEL

    from kvmesh.router.config import router_config_from_dict
    from kvmesh.router.endpoints import normalize_url
    from kvmesh.router.gateway import ENDPOINT_HEADER, Gateway

    es = await engines(3)
    config = router_config_from_dict(
        {"endpoints": [{"url": e.url} for e in es], "policy": "precise", "seed": 1}
    )
    gw = Gateway(config, tokenizer=tokenizer)
    client = TestClient(TestServer(gw.app))
    await client.start_server()
    try:
        for _ in range(500):
            if (
                gw.model is not None
                and gw.pool is not None
                and all(e.state.healthy for e in gw.pool.endpoints)
            ):
                break
            await asyncio.sleep(0.01)
        system = long_document(30_000, 11)
        text = system + " Question: " + long_document(20_000, 12)
        full = tokenizer.encode_piece(text, True)
        hasher = gw.scheduler.hasher(Namespace(gw.model or MODEL, gw.revision or ""))
        keys = hasher.hash_blocks(as_token_array(full))
        holder = PodId(normalize_url(es[2].url))
        gw.index.add(
            keys[: len(tokenizer.encode_piece(system, True)) // 16 - 2], holder, medium_set(Medium.GPU)
        )
        assert tokenizer.prefixes is not None
        learnt = tokenizer.prefixes.num_learnt
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 2})
        assert resp.status == 200, await resp.text()
        assert resp.headers[ENDPOINT_HEADER] == holder
        assert tokenizer.prefixes.num_learnt == learnt + 1  # tokenized until the first miss, held part kept
        metrics = await (await client.get("/metrics")).text()
        line = next(x for x in metrics.splitlines() if x.startswith("kvmesh_router_prompt_tokens_total"))
        assert abs(float(line.split()[-1]) - len(full)) < 0.03 * len(full)  # the estimate, close
    finally:
        await client.close()


class _UnreachableIndex(InMemoryIndex):
    """An index whose lookups fail as a remote index's do when its server is down."""

    def lookup(self, keys: Iterable[BlockKey]) -> list[Holders]:
        raise TierUnavailableError("index server down")


def test_off_loop_matching_and_an_unreachable_index(tokenizer):
    text = long_document(20_000, 13)
    full = tokenizer.encode_piece(text, True)
    sched = scheduler(InMemoryIndex())
    hold(sched, full, 700, POD_A)
    routing = RoutingRequest("r", as_token_array([]), NAMESPACE)
    found = asyncio.run(tokenize_until_miss(LongPrompt(text, True, tokenizer), routing, sched, off_loop=True))
    assert found.pods[POD_A].num_blocks == 700
    # a dead index is a miss: routed by load, the prompt's length still estimated
    text = long_document(20_000, 14)
    full = tokenizer.encode_piece(text, True)
    routing = RoutingRequest("r", as_token_array([]), NAMESPACE)
    found = asyncio.run(
        tokenize_until_miss(
            LongPrompt(text, True, tokenizer), routing, scheduler(_UnreachableIndex()), off_loop=True
        )
    )
    assert found.pods == {} and found.shared is None
    assert routing.num_prompt_tokens is not None and abs(routing.num_prompt_tokens - len(full)) < 0.03 * len(
        full
    )
    assert found.num_blocks == routing.num_prompt_tokens // 16


def test_known_prefixes_stay_within_their_character_budget(tokenizer):
    from kvmesh.router.prefix_tokens import PrefixReuse

    reuse = PrefixReuse(tokenizer.inner.fast_backend, key_chars=8, min_chars=16, max_chars=3000)
    docs = [f"doc{i:03d} " + long_document(150, i) for i in range(10)]  # ~1,000 characters each
    for doc in docs:
        reuse.remember(doc, tokenizer.encode_piece(doc, True), True)
    assert reuse.num_learnt == 10
    assert reuse.longest_known(docs[0] + " more", True) is None  # the oldest left
    known = reuse.longest_known(docs[-1] + " more", True)
    assert known is not None and known.text == docs[-1]
    assert known.array.tolist() == tokenizer.encode_piece(docs[-1], True)
    kept = sum(len(p.text) for prefixes, _ in reuse._groups.values() for p in prefixes)
    assert kept == reuse._chars <= 3000


@settings(max_examples=300, deadline=None)
@given(
    a=st.text(alphabet="ab ", max_size=3000),
    b=st.text(alphabet="ab ", max_size=3000),
    shared=st.integers(0, 3000),
)
def test_common_length_is_the_common_prefix(a, b, shared):
    from kvmesh.router.prefix_tokens import _common_length

    b = a[:shared] + b
    want = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    assert _common_length(a, b) == want


def test_a_start_shared_by_recent_prompts_is_learnt_without_any_cache(tokenizer):
    sched = scheduler(InMemoryIndex())  # nothing held anywhere
    system = "Shared manual: " + long_document(20_000, 21)
    reuse = tokenizer.prefixes
    assert reuse is not None
    learnt, reused = reuse.num_learnt, reuse.num_reused
    route(sched, tokenizer, system + " First question?")
    assert reuse.num_learnt == learnt  # one prompt: nothing to share with yet
    route(sched, tokenizer, system + " Second question?")
    assert reuse.num_learnt == learnt + 1
    third = system + " Third question, " + long_document(30, 22)
    routing, found = route(sched, tokenizer, third)
    assert reuse.num_reused == reused + 1
    full = tokenizer.encode_piece(third, True)
    assert [int(t) for t in routing.tokens] == full  # the short rest was one piece
    assert routing.num_prompt_tokens is None and found.num_blocks == len(full) // 16
