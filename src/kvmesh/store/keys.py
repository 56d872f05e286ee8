"""Store keys: which namespace group a chunk belongs to, and its chained chunk key.

A chunk's :class:`~kvmesh.core.types.BlockKey` already encodes the whole prefix and the full
namespace (model, revision, LoRA, tenant, KV dtype and layout). The *group* is a short digest of
model, revision and LoRA only: every backend files chunks under it, so ``flush`` of a model
revision or a LoRA drops all its chunks (every tenant, every KV format) without reading any::

    redis key      <prefix>:<group>:<chunk key hex>
    disk / shared  <root>/<group>/<chunk key hex>.kvc
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvmesh.core.hashing import Namespace, hex_key, key_from_hex
from kvmesh.core.types import BlockKey

GROUP_HEX_CHARS = 16


def namespace_group(namespace: Namespace) -> str:
    """The flush group of ``namespace``: 16 hex chars of sha256(model, revision, LoRA)."""
    raw = Namespace(namespace.model, namespace.revision, namespace.lora).encode()
    return hashlib.sha256(raw).hexdigest()[:GROUP_HEX_CHARS]


def is_group(text: str) -> bool:
    """Whether ``text`` has the form of a group id (used to skip foreign directories and keys)."""
    if len(text) != GROUP_HEX_CHARS:
        return False
    try:
        int(text, 16)
    except ValueError:
        return False
    return text == text.lower()


@dataclass(frozen=True, slots=True)
class StoreKey:
    """Where one chunk lives in every backend."""

    group: str
    """Flush group, see :func:`namespace_group`."""
    chunk: BlockKey
    """The chain value at the chunk's last block."""

    def name(self) -> str:
        """``<group>/<chunk hex>``: the relative name backends derive paths and keys from."""
        return f"{self.group}/{hex_key(self.chunk)}"

    @classmethod
    def parse(cls, name: str) -> StoreKey:
        """Inverse of :meth:`name`.

        Raises:
            ValueError: ``name`` is not ``<group>/<chunk hex>``.
        """
        group, sep, chunk = name.partition("/")
        if not sep or not is_group(group):
            raise ValueError(f"not a store key name: {name!r}")
        return cls(group, key_from_hex(chunk))
