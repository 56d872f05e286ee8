"""Learnt prefixes' packed ids and memoised block keys give exactly what the plain paths give:
the same ids, the same keys, the same history scores; prompts tokenized inline or on a thread
alike."""

from __future__ import annotations

import asyncio
import json
import random
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace, as_token_array, tokens_to_bytes
from kvmesh.core.tokens import Tokenizer
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.router.index import InMemoryIndex, medium_set
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.known_prefix import MAX_HASHERS, KnownPrefix, join_ids, prompt_block_keys
from kvmesh.router.plugins.scorers import ApproximatePrefixScorer
from kvmesh.router.prefix import iter_block_keys, match_prefix
from kvmesh.router.prefix_tokens import PrefixReuse
from kvmesh.router.request_parser import RequestParser
from kvmesh.router.tokenize import CachedTokenizer
from kvmesh.router.types import EndpointState, RoutingRequest

PODS = [PodId(f"http://p{i}:1") for i in range(3)]
_SMOLLM2: list[Tokenizer] = []


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    if not _SMOLLM2:
        _SMOLLM2.append(Tokenizer.load("smollm2"))
    return _SMOLLM2[0]


IDS = st.lists(st.integers(0, 2**32 - 1), max_size=90)


@settings(max_examples=300, deadline=None)
@given(
    ids=IDS,
    known_len=st.integers(0, 90),
    block_size=st.integers(1, 9),
    algo=st.sampled_from(list(HashAlgo)),
    tenant=st.sampled_from(["", "t1", "t2"]),
)
def test_prompt_keys_with_a_known_prefix_equal_hashing_every_block(ids, known_len, block_size, algo, tenant):
    known = KnownPrefix("x" * known_len, ids[:known_len])
    hasher = BlockHasher(Namespace("m", "", "", tenant), block_size, algo)
    want = hasher.hash_blocks(as_token_array(ids))
    assert prompt_block_keys(hasher, as_token_array(ids), known) == want
    assert prompt_block_keys(hasher, ids, known) == want  # memoised the second time
    assert prompt_block_keys(hasher, ids, None) == want
    assert join_ids(known, ids[known_len:]).array.tolist() == ids


def test_a_prefix_keeps_keys_for_a_bounded_number_of_hashers():
    known = KnownPrefix("x", list(range(64)))
    hashers = [BlockHasher(Namespace("m", "", "", f"t{i}"), 4, HashAlgo.XXH3) for i in range(MAX_HASHERS + 3)]
    for hasher in hashers + hashers[:2]:
        assert known.block_keys(hasher) == hasher.hash_blocks(as_token_array(list(range(64))))
    assert len(known._keys) == MAX_HASHERS
    with pytest.raises(ValueError):
        known.array[0] = 1  # shared by every request that starts with it


PIECES = [
    " ",
    "  ",
    "\n",
    "a",
    "Rule",
    "'s",
    "12",
    "!",
    "é",
    "中文",
    "\u00a0",
    "<|im_end|>",
    "word",
    " 42",
    ":",
]


@settings(max_examples=30, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(0, 40))
def test_encode_ids_equals_a_full_encode_or_declines_over_its_limit(smollm2, rng, max_chars):
    tok = CachedTokenizer(smollm2, cache_entries=8)
    assert tok.composes
    tok.prefixes = PrefixReuse(smollm2.fast_backend, key_chars=4, min_chars=8)
    bases = ["Sys " + "".join(rng.choice(PIECES) for _ in range(rng.randrange(8, 40))) for _ in range(2)]
    for _ in range(20):
        base = rng.choice(bases)
        text = base + " " + "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 8)))
        special = rng.random() < 0.5
        full = smollm2.encode(text, add_special_tokens=special)
        limited = tok.encode_ids(text, add_special_tokens=special, max_chars=max_chars)
        found = tok.encode_ids(text, add_special_tokens=special)
        assert found is not None and found.array.tolist() == full
        if limited is not None:
            assert limited.array.tolist() == full
            tokenized = len(text) - (0 if limited.known is None else len(limited.known.text))
            assert tokenized <= max_chars or (text, special) in _cached(tok)
        if found.known is not None:
            assert text.startswith(found.known.text)
            assert found.array[: len(found.known)].tolist() == found.known.array.tolist()
    assert tok.prefixes.num_rejected == 0


def _cached(tok: CachedTokenizer) -> set[tuple[str, bool]]:
    return {(text, bool(flag)) for flag, text in tok._cache if isinstance(text, str)}


def test_chat_ids_equal_the_chat_template(smollm2):
    tok = CachedTokenizer(smollm2)
    system = "You are careful. " + " ".join(f"Rule {i}: cite sources." for i in range(60))
    for i in range(4):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]
        want = smollm2.apply_chat_template(messages)
        assert tok.chat_ids(messages, max_chars=10_000_000).array.tolist() == want
        assert tok.apply_chat_template(messages) == want


class _KeyByKeyHistory:
    """The history scorer's walk and update going key by key, as the scorer first did them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.history: OrderedDict[BlockKey, dict[PodId, None]] = OrderedDict()

    def score(self, keys: list[BlockKey], endpoints: list[EndpointState]) -> list[float]:
        if not keys:
            return [0.0] * len(endpoints)
        matched: dict[PodId, int] = {}
        alive: set[PodId] | None = None
        for depth, key in enumerate(keys):
            holders = self.history.get(key)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders.keys()
            if not alive:
                break
            for pod in alive:
                matched[pod] = depth + 1
        return [matched.get(e.pod, 0) / len(keys) for e in endpoints]

    def observe(self, keys: list[BlockKey], pod: PodId) -> None:
        for key in keys:
            holders = self.history.get(key)
            if holders is None:
                self.history[key] = {pod: None}
            else:
                if pod not in holders:
                    self.history[key] = dict.fromkeys((*holders, pod))
                self.history.move_to_end(key)
        while len(self.history) > self.capacity:
            self.history.popitem(last=False)


def _history_run(requests: list[tuple[list[int], int, int]], with_known: bool) -> list[Any]:
    scorer = ApproximatePrefixScorer(block_size=4, capacity=40, beyond_cache=False)
    reference = _KeyByKeyHistory(capacity=40)
    hasher = BlockHasher(Namespace("m"), 4, HashAlgo.XXH3)
    endpoints = [EndpointState(pod=p) for p in PODS]
    prefixes: dict[tuple[int, ...], KnownPrefix] = {}
    out = []
    for i, (ids, known_len, to) in enumerate(requests):
        head = tuple(ids[:known_len])
        known = prefixes.setdefault(head, KnownPrefix("", list(head))) if with_known else None
        request = RoutingRequest(f"r{i}", as_token_array(ids), Namespace("m"), known_prefix=known)
        scores = scorer.score(request, endpoints)
        assert scores == reference.score(hasher.hash_blocks(ids), endpoints)
        out.append(scores)
        scorer.observe(request, PODS[to])
        reference.observe(hasher.hash_blocks(ids), PODS[to])
        got = [(k, list(v)) for k, v in scorer._history.items()]
        assert got == [(k, list(v)) for k, v in reference.history.items()]  # same keys, order, holders
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 30), st.integers(0, 40), st.integers(0, 2)),
        min_size=1,
        max_size=25,
    )
)
@example(shape=[(0, 0, 4, 1), (0, 0, 8, 0), (0, 0, 8, 1), (0, 0, 8, 2)])  # equal maps in another order
def test_history_scores_and_lru_equal_going_key_by_key_with_or_without_known_prefixes(shape):
    starts = [[s * 1000 + j for j in range(48)] for s in range(4)]
    requests = [
        (starts[start][:cut] + [7_000_000 + n + k for k in range(n % 9)], min(cut, known), to)
        for n, (start, known, cut, to) in enumerate(shape)
    ]
    assert _history_run(requests, True) == _history_run(requests, False)


def _body(text: str) -> bytes:
    return json.dumps({"model": "m", "prompt": text}).encode()


async def _parse_all(parser: RequestParser, texts: list[str]) -> list[Any]:
    return [await parser.parse(_body(t), {}, chat=False, model=None, revision=None) for t in texts]


def test_prompts_after_a_learnt_start_are_tokenized_inline_and_equal_the_thread_path(smollm2, monkeypatch):
    rng = random.Random(5)
    system = "You are assistant #1. " + " ".join(f"Rule {i}: be brief." for i in range(900))  # ~7k tokens
    texts = [f"{system}\nQuestion {i}: what is {rng.randrange(10**6)} squared?" for i in range(6)]
    threaded = RequestParser(CachedTokenizer(smollm2), tokenize_thread_min_chars=1)
    inline = RequestParser(CachedTokenizer(smollm2), tokenize_thread_min_chars=8192)
    hops: list[Any] = []
    real_to_thread = asyncio.to_thread

    async def counting_to_thread(func: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(func)
        return await real_to_thread(func, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counting_to_thread)
    want = asyncio.run(_parse_all(threaded, texts))
    assert len(hops) == len(texts)
    hops.clear()
    got = asyncio.run(_parse_all(inline, texts))
    assert len(hops) == 2  # the first two prompts teach the shared start; the rest are inline
    for a, b, text in zip(want, got, texts, strict=True):
        assert np.array_equal(a.routing.tokens, b.routing.tokens)
        assert b.routing.tokens.tolist() == smollm2.encode(text)
    known = got[-1].routing.known_prefix
    assert known is not None and known.text.startswith(system) and texts[-1].startswith(known.text)


def _summary(match: Any) -> tuple[Any, ...]:
    pods = {pod: (m.num_blocks, m.blocks_by_tier) for pod, m in match.pods.items()}
    return match.num_blocks, pods, None if match.shared is None else match.shared.num_blocks


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 50), max_size=80),
    known_len=st.integers(0, 80),
    shorter=st.integers(0, 80),
    block_size=st.integers(1, 6),
    held=st.lists(st.tuples(st.sampled_from(PODS), st.integers(0, 40)), max_size=3),
)
def test_matching_with_a_known_prefix_equals_hashing_every_block(ids, known_len, shorter, block_size, held):
    hasher = BlockHasher(Namespace("m"), block_size, HashAlgo.XXH3)
    keys = hasher.hash_blocks(ids)
    index = InMemoryIndex()
    for pod, n in held:
        if keys[:n]:
            index.add(keys[:n], pod, medium_set(Medium.GPU))
    known = KnownPrefix("", ids[:known_len])
    # a shorter prompt with the same start first: the kept keys grow only as far as consumed
    head = as_token_array(ids[: min(shorter, len(ids))])
    assert _summary(match_prefix(index, hasher, head, None, known if shorter >= known_len else None)) == (
        _summary(match_prefix(index, hasher, head))
    )
    arr = as_token_array(ids)
    assert list(iter_block_keys(hasher, arr, None, known)) == keys
    assert _summary(match_prefix(index, hasher, arr, None, known)) == _summary(
        match_prefix(index, hasher, arr)
    )
    assert list(iter_block_keys(hasher, ids, None, known)) == keys  # kept keys, a list prompt
    # with a memo of event keys (kept for sha256 keys) for the blocks after the prefix
    sha = BlockHasher(Namespace("m"), block_size, HashAlgo.SHA256)
    sha_keys = sha.hash_blocks(ids)
    memo = BlockKeyMemo(1000)
    half = len(sha_keys) // 2
    memo.remember(sha.root, tokens_to_bytes(ids[: half * block_size]), sha_keys[:half])
    assert memo.walk(sha.root, tokens_to_bytes(ids[: half * block_size]), block_size * 4) == sha_keys[:half]
    assert list(iter_block_keys(sha, arr, memo, KnownPrefix("", ids[:known_len]))) == sha_keys


def test_a_cold_prompt_with_a_long_known_prefix_hashes_only_what_matching_consumes():
    ids = list(range(16 * 1000))
    known = KnownPrefix("", ids)
    hasher = BlockHasher(Namespace("m"), 16, HashAlgo.XXH3)
    found = match_prefix(InMemoryIndex(), hasher, as_token_array(ids), None, known)
    assert found.pods == {} and found.num_blocks == 1000
    assert len(known._keys[(hasher.namespace, 16, HashAlgo.XXH3)]) == 2  # the first group only
