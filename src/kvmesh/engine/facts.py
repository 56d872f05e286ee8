"""What an engine tells routers about itself, and the narrow view its describing routes get.

One :class:`EngineFacts`, built once when the server is, answers ``/kvmesh/info`` and the documents
peer routers read (:mod:`kvmesh.engine.peer_api`); :class:`ServedModel` is all those routes see of
the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmesh.core.tenancy import Role
from kvmesh.core.tokens import Tokenizer


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """An engine's fixed facts: names, block keys, event stream, sizes."""

    served_model_name: str
    model_path: str
    """Where the tokenizer loads from (the served name where no directory is known)."""
    revision: str
    block_size: int
    hash_algo: str
    events_endpoint: str | None
    replay_endpoint: str | None
    events_topic: str | None
    role: Role
    kv_layout: str
    kv_dtype: str
    kv_bytes_per_token: int
    max_model_len: int
    vocab_size: int
    """The model's vocabulary."""
    prompt_vocab_size: int
    """Ids a prompt may hold: the smaller of the model's and the tokenizer's vocabularies."""
    num_blocks: int
    """Device-tier KV blocks."""
    max_num_seqs: int
    max_num_batched_tokens: int
    emulate: str | None
    device: str
    has_store: bool
    extra_info: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def info_dict(self) -> dict[str, Any]:
        """The ``/kvmesh/info`` document."""
        return {
            "model": self.served_model_name,
            "revision": self.revision,
            "block_size": self.block_size,
            "hash_algo": self.hash_algo,
            "events_endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "events_topic": self.events_topic,
            "role": self.role.value,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "max_model_len": self.max_model_len,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "emulate": self.emulate,
            "device": self.device,
            "store": self.has_store,
            **self.extra_info,
        }


class ServedModel(Protocol):
    """What the routes that describe an engine or render prompts read of it."""

    facts: EngineFacts
    tokenizer: Tokenizer

    def check_model(self, model: str | None) -> None:
        """Raise a 404 :class:`~kvmesh.errors.RequestError` unless ``model`` is ``None`` or served here."""
        ...
