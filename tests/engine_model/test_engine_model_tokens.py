"""Tokenizer wrapper: chat templates, encode/decode, EOS ids, streaming detokenization."""

from __future__ import annotations

import pytest

from kvmesh.core.tokens import Tokenizer
from kvmesh.errors import RequestError


@pytest.fixture(scope="module")
def tiny_tok() -> Tokenizer:
    return Tokenizer.load("tiny-random-llama")


@pytest.fixture(scope="module")
def smol_tok(smollm2_runner) -> Tokenizer:
    return Tokenizer.load("smollm2")


def test_tiny_tokenizer_is_byte_level(tiny_tok: Tokenizer) -> None:
    text = "héllo, wörld ✓"
    ids = tiny_tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert tiny_tok.decode(ids) == text
    assert tiny_tok.decode(ids[:2]) == "h\ufffd"  # a cut multi-byte character
    assert tiny_tok.eos_token_ids == (2,)
    assert tiny_tok.vocab_size == 259


def test_tiny_chat_template_is_chatml(tiny_tok: Tokenizer) -> None:
    ids = tiny_tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == 1  # <|im_start|>
    assert (
        tiny_tok.decode(ids, skip_special_tokens=False)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tiny_tok.decode(ids) == "user\nhi\nassistant\n"


@pytest.mark.slow
def test_smollm2_chat_template_round_trip(smol_tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = smol_tok.render_chat(messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smol_tok.apply_chat_template(messages)
    assert smol_tok.decode(ids, skip_special_tokens=False) == text
    assert ids == smol_tok.encode(text, add_special_tokens=False)
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|>, <|im_end|>
    no_prompt = smol_tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(no_prompt)] == no_prompt and len(ids) > len(no_prompt)
    assert smol_tok.token_text(2) == "<|im_end|>"
    assert smol_tok.eos_token_ids == (2,)
    assert smol_tok.vocab_size == 49152
    assert smol_tok.name == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_smollm2_default_system_prompt(smol_tok: Tokenizer) -> None:
    text = smol_tok.render_chat([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_encode_decode_round_trip(smol_tok: Tokenizer) -> None:
    text = "KV caches for LLM fleets: naïve 東京 test 🚀."
    ids = smol_tok.encode(text)
    assert smol_tok.decode(ids) == text
    assert ids == smol_tok.encode(text, add_special_tokens=False)  # SmolLM2 adds no BOS


def test_bad_messages_are_request_errors(tiny_tok: Tokenizer) -> None:
    with pytest.raises(RequestError, match="non-empty"):
        tiny_tok.apply_chat_template([])
    with pytest.raises(RequestError, match=r"messages\[1\]"):
        tiny_tok.apply_chat_template([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(RequestError, match="chat template failed"):
        tiny_tok.apply_chat_template([{"role": "user"}])
    with pytest.raises(RequestError, match="chat template failed"):
        tiny_tok.apply_chat_template([{"role": "user", "content": 5}])  # the template's TypeError


class _BrokenTemplateCall:
    """A tokenizer whose chat-template call fails in kvmesh's own code, not in a template."""

    chat_template = "{{ messages }}"
    eos_token_id = 0

    def __len__(self) -> int:
        return 1

    def apply_chat_template(self, *args: object, **kwargs: object) -> str:
        raise TypeError("unexpected keyword argument")


def test_a_type_error_outside_the_template_is_not_a_request_error() -> None:
    tok = Tokenizer(_BrokenTemplateCall(), name="broken")
    with pytest.raises(TypeError, match="unexpected keyword"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_loading_leaves_the_process_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from kvmesh.core.models import resolve_model

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    before = dict(os.environ)
    tok = Tokenizer.from_dir(resolve_model("tiny-random-llama").path)
    assert tok.encode("hi") == [74, 75]
    assert dict(os.environ) == before
