"""Tokenizers: text and chat messages to token ids, exactly as the engine computes them.

The engine and the router both load :class:`Tokenizer` from the same model directory, so the router
hashes the very token ids the engine will cache. Conventions (vLLM's):

- ``encode`` of a completion prompt adds the tokenizer's special tokens (a BOS where the model has one).
- a chat is rendered with the model's chat template to text, then encoded *without* special tokens
  (the template already wrote them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvmesh.errors import ModelLoadError, RequestError

ChatMessage = Mapping[str, Any]
"""One OpenAI chat message: ``{"role": ..., "content": ...}``."""


class Tokenizer:
    """A model's tokenizer and chat template, loaded offline from a local directory."""

    def __init__(self, hf_tokenizer: Any, *, name: str = "") -> None:
        self._tok = hf_tokenizer
        self.name = name or str(getattr(hf_tokenizer, "name_or_path", ""))
        self.eos_token_ids: tuple[int, ...] = _eos_ids(hf_tokenizer)
        """Ids that end generation (the tokenizer's EOS plus the config's, deduplicated)."""
        self.vocab_size: int = len(hf_tokenizer)
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""

    @classmethod
    def from_dir(cls, path: str | Path, *, name: str = "") -> Tokenizer:
        """Load the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, chat template) of ``path``.

        Raises:
            ModelLoadError: the directory holds no loadable tokenizer.
        """
        try:
            from transformers import AutoTokenizer

            # local_files_only keeps the hub client off the network for this call alone
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, ImportError) as exc:
            raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc
        tok = cls(hf, name=name)
        extra = _config_eos_ids(Path(path))
        tok.eos_token_ids = tuple(dict.fromkeys((*tok.eos_token_ids, *extra)))
        return tok

    @classmethod
    def load(cls, spec: str | None = None) -> Tokenizer:
        """Resolve ``spec`` with :func:`kvmesh.core.models.resolve_model` and load its tokenizer."""
        from kvmesh.core.models import resolve_model

        files = resolve_model(spec)
        return cls.from_dir(files.path, name=files.name)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    @property
    def fast_backend(self) -> Any | None:
        """The Rust ``tokenizers.Tokenizer`` behind a fast HF tokenizer, or ``None``.

        Its ``encode_batch_fast`` returns the same ids as :meth:`encode` (no normalisation happens
        in the Python wrapper) without building offsets, for callers that only need ids.
        """
        backend = getattr(self._tok, "_tokenizer", None)
        return backend if hasattr(backend, "encode_batch_fast") else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 at the end comes out as U+FFFD."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat rendered by the model's chat template (``tools``: OpenAI function tools the
        template may list; templates that do not use them ignore them).

        Raises:
            RequestError: the messages are malformed or the model has no chat template.
        """
        if not self.has_chat_template:
            raise RequestError(f"model {self.name or '?'} has no chat template", param="messages")
        if not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise RequestError(f"messages[{i}] needs a string 'role'", param="messages")
        from jinja2 import TemplateError

        try:
            text = self._tok.apply_chat_template(
                [dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                tools=[dict(t) for t in tools] if tools else None,
            )
        except TemplateError as exc:  # UndefinedError, the template's raise_exception, ...
            raise RequestError(f"chat template failed on these messages: {exc}", param="messages") from exc
        except TypeError as exc:
            # a template's own operations on a message of the wrong shape (content 5, or a list where
            # it concatenates strings); a TypeError from anywhere else is a bug and propagates
            if not _raised_in_template(exc):
                raise
            raise RequestError(f"chat template failed on these messages: {exc}", param="messages") from exc
        return str(text)

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a chat: rendered with the model's template, encoded without extra specials."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """The vocabulary string of one id (special tokens included), e.g. for logprob listings."""
        return str(self._tok.convert_ids_to_tokens(int(token_id)))


def _raised_in_template(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while running compiled template code (jinja2 names it ``<template>``)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            return True
        tb = tb.tb_next
    return False


def _eos_ids(hf: Any) -> tuple[int, ...]:
    ids: list[int] = []
    eos = getattr(hf, "eos_token_id", None)
    if isinstance(eos, int):
        ids.append(eos)
    elif isinstance(eos, list | tuple):
        ids.extend(int(i) for i in eos)
    return tuple(dict.fromkeys(ids))


def _config_eos_ids(path: Path) -> tuple[int, ...]:
    """EOS ids named by ``config.json`` and ``generation_config.json`` (either may be a list)."""
    import json

    ids: list[int] = []
    for filename in ("config.json", "generation_config.json"):
        file = path / filename
        if not file.is_file():
            continue
        try:
            value = json.loads(file.read_text()).get("eos_token_id")
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(int(v) for v in value if isinstance(v, int))
    return tuple(ids)
