"""OpenAI bodies into routing requests: validation, tenant, prompt ids converted once."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from multidict import CIMultiDict

from kvmesh.core.hashing import Namespace
from kvmesh.errors import RequestError
from kvmesh.router.request_parser import RequestParser


class WordTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> list[int]:
        return self.encode(" ".join(m["content"] for m in messages))


async def parse(body: object, *, chat: bool = False, headers: dict[str, str] | None = None, tokenizer=None):
    parser = RequestParser(tokenizer, tokenize_thread_min_chars=8)
    raw = msgspec.json.encode(body)
    return await parser.parse(raw, CIMultiDict(headers or {}), chat=chat, model="m", revision="r1")


async def test_prompt_ids_become_one_u32_array():
    parsed = await parse({"prompt": [5, 6, 2**32 - 1]})
    tokens = parsed.routing.tokens
    assert isinstance(tokens, np.ndarray) and tokens.dtype == np.dtype("<u4")
    assert tokens.tolist() == [5, 6, 2**32 - 1]
    assert parsed.routing.namespace == Namespace("m", "r1", "", "")
    assert parsed.raw == msgspec.json.encode({"prompt": [5, 6, 2**32 - 1]})


@pytest.mark.parametrize("prompt", [[1, True], [1, -1], [1, 2**32], [1.5], [[1], [2]]])
async def test_bad_prompt_ids_are_rejected(prompt):
    with pytest.raises(RequestError) as info:
        await parse({"prompt": prompt})
    assert info.value.param == "prompt"


async def test_text_and_chat_are_tokenized_into_the_same_array_type():
    tok = WordTokenizer()
    short = await parse({"prompt": "ab c"}, tokenizer=tok)
    long = await parse({"prompt": "abcd efghij klm"}, tokenizer=tok)  # past 8 chars: worker thread
    chat = await parse({"messages": [{"role": "user", "content": "a bb"}]}, chat=True, tokenizer=tok)
    assert [p.routing.tokens.tolist() for p in (short, long, chat)] == [[2, 1], [4, 6, 3], [1, 2]]  # type: ignore[union-attr]
    assert all(isinstance(p.routing.tokens, np.ndarray) for p in (short, long, chat))
    assert tok.calls == 3
    untokenized = await parse({"prompt": "no tokenizer"})
    assert len(untokenized.routing.tokens) == 0


async def test_header_tenant_is_added_as_cache_salt_and_conflicts_are_rejected():
    parsed = await parse({"prompt": [1]}, headers={"X-Tenant-Id": "acme"})
    assert parsed.tenant == "acme" and parsed.routing.namespace.tenant == "acme"
    assert msgspec.json.decode(parsed.raw) == {"prompt": [1], "cache_salt": "acme"}
    with pytest.raises(RequestError) as info:
        await parse({"prompt": [1], "cache_salt": "globex"}, headers={"x-tenant-id": "acme"})
    assert info.value.param == "cache_salt"


async def test_session_header_and_request_ids():
    parser = RequestParser(None, tokenize_thread_min_chars=8)
    raw = msgspec.json.encode({"prompt": [1]})
    first = await parser.parse(
        raw, CIMultiDict({"x-session-id": "s1"}), chat=False, model=None, revision=None
    )
    second = await parser.parse(raw, CIMultiDict(), chat=False, model=None, revision=None)
    assert first.routing.session_id == "s1" and second.routing.session_id is None
    assert first.routing.request_id != second.routing.request_id
    assert first.routing.namespace == Namespace("", "", "", "")
