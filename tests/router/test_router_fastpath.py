"""Fast paths of matching and tokenizing give exactly what the plain computations give."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.errors import ConfigError
from kvmesh.router.cli import new_event_loop
from kvmesh.router.config import RouterConfig, router_config_from_dict
from kvmesh.router.index import InMemoryIndex, MediumSet, best_medium, medium_set
from kvmesh.router.keymemo import BlockKeyMemo
from kvmesh.router.prefix import match_prefix_keys
from kvmesh.router.tokenize import CachedTokenizer

PODS = [PodId(f"http://p{i}:1") for i in range(4)]
MEDIA = [
    medium_set(Medium.GPU),
    medium_set(Medium.CPU),
    medium_set(Medium.GPU, Medium.CPU),
    medium_set(Medium.SHARED),
]


def reference_match(chain: list[dict[PodId, MediumSet]]) -> dict[PodId, tuple[int, dict[Medium, int]]]:
    """Per pod: consecutive blocks from 0 it holds, and their best tiers, counted one by one."""
    out: dict[PodId, tuple[int, dict[Medium, int]]] = {}
    for pod in chain[0] if chain else {}:
        n, tiers = 0, {}
        for holders in chain:
            if pod not in holders:
                break
            n += 1
            tier = best_medium(holders[pod])
            tiers[tier] = tiers.get(tier, 0) + 1
        out[pod] = (n, tiers)
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.dictionaries(st.sampled_from(PODS), st.sampled_from(MEDIA), min_size=0, max_size=4),
        min_size=0,
        max_size=40,
    )
)
def test_match_prefix_keys_equals_block_by_block_count(blocks):
    index = InMemoryIndex()
    keys = [BlockKey(i.to_bytes(16, "little")) for i in range(len(blocks))]
    for key, holders in zip(keys, blocks, strict=True):
        for pod, media in holders.items():
            index.add([key], pod, media)
    chain = index.lookup(keys)
    got = match_prefix_keys(index, iter(keys), len(keys), 16)
    want = reference_match(chain)
    assert {pod: (m.num_blocks, m.blocks_by_tier) for pod, m in got.pods.items()} == want


def test_lookup_touches_only_the_matched_keys():
    index = InMemoryIndex(capacity=4)
    keys = [BlockKey(bytes([i]) * 16) for i in range(4)]
    index.add(keys, PODS[0], MEDIA[0])
    index.remove([keys[2]], PODS[0])  # the chain breaks at key 2
    assert len(index.lookup(keys)) == 2  # touches keys 0 and 1 only
    # LRU order is now 3, 0, 1: two new keys fill the capacity and evict key 3
    index.add([BlockKey(b"\xee" * 16), BlockKey(b"\xef" * 16)], PODS[0], MEDIA[0])
    assert index.lookup([keys[3]]) == []
    assert len(index.lookup(keys[:2])) == 2


def _memo_chain(n: int, stride: int = 64) -> tuple[BlockKeyMemo, bytes, list[BlockKey]]:
    hasher = BlockHasher(Namespace("m"), stride // 4, HashAlgo.XXH3)
    tokens = list(range(n * stride // 4))
    keys = hasher.hash_blocks(tokens)
    memo = BlockKeyMemo()
    raw = b"".join(t.to_bytes(4, "little") for t in tokens)
    memo.remember(hasher.root, raw, keys)
    return memo, raw, [hasher.root, *keys]


def test_memo_walk_stops_at_the_first_miss_and_ignores_a_partial_block():
    memo, raw, chain = _memo_chain(6)
    root = chain[0]
    assert memo.walk(root, raw, 64) == chain[1:]
    assert memo.walk(root, raw + b"\x01\x02", 64) == chain[1:]  # trailing partial block ignored
    broken = raw[: 3 * 64] + b"\xff" * 64 + raw[4 * 64 :]
    assert memo.walk(root, broken, 64) == chain[1:4]  # blocks 4.. chain from the missed key
    assert memo.walk(BlockKey(b"\x00" * 16), raw, 64) == []
    assert memo.walk(chain[3], raw[3 * 64 :], 64) == chain[4:]
    assert memo.walk(root, b"", 64) == []


class _PlainTokenizer:
    """A tokenizer without a fast backend: one id per character; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, messages: Any, *, add_generation_prompt: bool = True) -> list[int]:
        self.calls += 1
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""), add_special_tokens=False)


def test_cache_is_exact_match_and_keyed_by_flags():
    inner = _PlainTokenizer()
    tok = CachedTokenizer(inner, cache_entries=8)
    assert tok.encode("abc") == [1, 97, 98, 99]
    assert tok.encode("abc") == [1, 97, 98, 99]
    assert inner.calls == 1 and tok.num_hits == 1
    assert tok.encode("abc", add_special_tokens=False) == [97, 98, 99]
    assert tok.encode("abd") == [1, 97, 98, 100]
    msgs = [{"role": "user", "content": "hi"}]
    want = inner.apply_chat_template(msgs)
    assert tok.apply_chat_template(msgs) == want
    calls = inner.calls
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == want  # an equal list hits
    assert inner.calls == calls
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == inner.apply_chat_template(
        msgs, add_generation_prompt=False
    )
    assert tok.apply_chat_template([{"role": "user", "content": "hi!"}])[-12:-11] == [ord("!")]


def test_cache_is_bounded_least_recent_first_and_skips_long_inputs():
    inner = _PlainTokenizer()
    tok = CachedTokenizer(inner, cache_entries=2, cache_max_chars=5)
    tok.encode("a")
    tok.encode("b")
    tok.encode("a")  # a is now the most recent
    tok.encode("c")  # evicts b
    assert len(tok) == 2
    calls = inner.calls
    tok.encode("a")
    tok.encode("b")
    assert inner.calls == calls + 1
    tok.encode("toolong")
    tok.encode("toolong")
    assert inner.calls == calls + 3
    off = CachedTokenizer(inner, cache_entries=0)
    off.encode("a")
    off.encode("a")
    assert len(off) == 0 and inner.calls == calls + 5
    with pytest.raises(ValueError, match="-1"):
        CachedTokenizer(inner, cache_entries=-1)


def test_cache_under_concurrent_threads_returns_each_prompts_ids():
    tok = CachedTokenizer(_PlainTokenizer(), cache_entries=16)
    prompts = [f"prompt {i}" for i in range(64)]
    errors: list[str] = []

    def work() -> None:
        for p in prompts * 5:
            if tok.encode(p) != [1, *map(ord, p)]:
                errors.append(p)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(tok) == 16


_TOKENIZER: list[Any] = []


def _load_smollm2() -> Any:
    if not _TOKENIZER:
        from kvmesh.core.tokens import Tokenizer

        _TOKENIZER.append(Tokenizer.load("smollm2"))
    return _TOKENIZER[0]


@pytest.fixture
def smollm2():
    return _load_smollm2()


@pytest.fixture(scope="module")
def smollm2_module():
    return _load_smollm2()


TEXTS = [
    "Hello",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n",
    "Ünïcödé — émoji 🚀🚀 and 中文字符",
    "<|im_start|>user\nliteral special tokens<|im_end|>",
    "<|endoftext|>",
    "x" * 3000,
    "numbers 1234567890 3.14159 -42 1e-9",
    "You are assistant #3. Rule 0: be brief.\nQuestion 7: what is 12345 squared?",
]


def test_fast_encode_equals_the_tokenizer(smollm2):
    assert smollm2.fast_backend is not None
    tok = CachedTokenizer(smollm2, cache_entries=0)
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == smollm2.encode(
                text, add_special_tokens=special
            ), text


def test_cached_chat_equals_the_tokenizer(smollm2):
    tok = CachedTokenizer(smollm2)
    chats = [[{"role": "user", "content": t}] for t in TEXTS] + [
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]
    ]
    for _ in range(2):  # second pass from the cache
        for messages in chats:
            for gen in (True, False):
                assert tok.apply_chat_template(messages, add_generation_prompt=gen) == (
                    smollm2.apply_chat_template(messages, add_generation_prompt=gen)
                )
    assert tok.num_hits == len(chats) * 2


def test_event_loop_choice():
    loop = new_event_loop("auto")
    try:
        assert type(loop).__module__.startswith("uvloop")
        assert loop.run_until_complete(asyncio.sleep(0, result=7)) == 7
    finally:
        loop.close()
    loop = new_event_loop("asyncio")
    try:
        assert not type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


def test_router_keys_default_to_xxh3_and_sha256_stays_selectable():
    assert RouterConfig().hash_algo == "xxh3"
    assert router_config_from_dict({"hashAlgo": "sha256"}).hash_algo == "sha256"
    with pytest.raises(ConfigError, match="tokenizerCacheEntries"):
        router_config_from_dict({"tokenizerCacheEntries": -1})


PIECES = [
    " ", "  ", "\n", "\n\n", "\t", " \n", "\r\n", "a", "Rule", "Rules", "'s", "'ll", "'", "12", "3.5",
    "!", "?!", "é", "中文", "🚀", "\u00a0", "\u3000", "\x1c", "<|im_start|>", "<|im_end|>",
    "<|endoftext|>", "-", "—", "(", '"', "word", " word", " 42", ":", "_", "a'b",
]  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(st.randoms(use_true_random=False))
def test_prefix_reuse_equals_full_encoding(smollm2_module, rng):
    from kvmesh.router.prefix_tokens import PrefixReuse

    backend = smollm2_module.fast_backend
    reuse = PrefixReuse(backend, key_chars=4, min_chars=8)
    bases = ["".join(rng.choice(PIECES) for _ in range(rng.randrange(8, 60))) for _ in range(3)]
    for _ in range(25):
        base = rng.choice(bases)
        text = base[: rng.randrange(len(base) + 1)] + "".join(
            rng.choice(PIECES) for _ in range(rng.randrange(0, 10))
        )
        for special in (True, False):
            assert reuse.encode(text, special) == smollm2_module.encode(text, add_special_tokens=special), (
                text
            )
    assert reuse.num_rejected == 0


def test_prefix_reuse_learns_shared_system_prompts(smollm2):
    tok = CachedTokenizer(smollm2, cache_entries=0)
    assert tok.prefixes is not None
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: cite sources." for i in range(40))
    prompts = [f"{system}\nQuestion {i}: what is {i * 7919} squared?" for i in range(20)]
    for prompt in prompts:
        assert tok.encode(prompt) == smollm2.encode(prompt)
    assert tok.prefixes.num_learnt == 1
    assert tok.stats()["prefixes_reused"] == len(prompts) - 2 and tok.stats()["prefixes_rejected"] == 0
    assert tok.prefixes.num_reused == len(prompts) - 2  # the first two prompts teach the prefix
    # a prompt continuing the prefix without a space at the cut is tokenized in full
    glued = system + "X" + prompts[0][len(system) :]
    assert tok.encode(glued) == smollm2.encode(glued)


def test_prefix_reuse_refuses_tokenizers_it_cannot_reason_about(smollm2):
    import json

    from kvmesh.router.prefix_tokens import PrefixReuse

    spec = json.loads(smollm2.fast_backend.to_str())
    assert PrefixReuse.supports(smollm2.fast_backend)

    class Described:
        def __init__(self, spec: dict[str, Any]) -> None:
            self.spec = spec

        def to_str(self) -> str:
            return json.dumps(self.spec)

    def altered(path: list[str], value: Any) -> Described:
        changed = json.loads(json.dumps(spec))
        node = changed
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return Described(changed)

    assert PrefixReuse.supports(Described(spec))
    assert not PrefixReuse.supports(altered(["pre_tokenizer", "add_prefix_space"], True))
    assert not PrefixReuse.supports(altered(["pre_tokenizer"], {"type": "Metaspace"}))
    assert not PrefixReuse.supports(altered(["normalizer"], {"type": "NFC"}))
    assert not PrefixReuse.supports(altered(["model", "type"], "Unigram"))
    added = [dict(spec["added_tokens"][0], content="<a b>")]
    assert not PrefixReuse.supports(altered(["added_tokens"], added))
    added = [dict(spec["added_tokens"][0], rstrip=True)]
    assert not PrefixReuse.supports(altered(["added_tokens"], added))
    eos_after = {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A"}}, {"SpecialToken": {}}]}
    assert not PrefixReuse.supports(altered(["post_processor"], eos_after))
    assert not PrefixReuse.supports(object())
