"""The namespaces KV event chains hash into, each with a small id the applier keeps per block.

The namespace of a chain comes from its first block: the model (fixed per router), ``lora_name``
and the tenant salt found in ``extra_keys`` of block 0 (vLLM's ``cache_salt`` travels the same way).
"""

from __future__ import annotations

from typing import Any

from kvmesh.core.events import BlockStored
from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace


class ChainNamespaces:
    """The namespaces seen so far, numbered in order of first use, with their cached hashers.

    Args:
        model: the model of every namespace.
        revision: its revision.
        block_size: the router's tokens per block.
        algo: the engines' key digest.
    """

    def __init__(self, model: str, revision: str, block_size: int, algo: HashAlgo) -> None:
        self.model = model
        self.revision = revision
        self.block_size = block_size
        self.algo = algo
        self._namespaces: list[Namespace] = []
        self._hashers: dict[tuple[str, str], tuple[BlockHasher, int]] = {}
        self._by_id: list[BlockHasher] = []

    def namespace(self, lora: str = "", tenant: str = "") -> Namespace:
        """The namespace requests with this LoRA and tenant hash into."""
        return Namespace(self.model, self.revision, lora, tenant)

    def hasher(self, lora: str = "", tenant: str = "") -> tuple[BlockHasher, int]:
        """The (cached) block hasher of one namespace and the namespace's id."""
        entry = self._hashers.get((lora, tenant))
        if entry is None:
            ns = self.namespace(lora, tenant)
            entry = (BlockHasher(ns, self.block_size, self.algo), len(self._namespaces))
            self._namespaces.append(ns)
            self._by_id.append(entry[0])
            self._hashers[(lora, tenant)] = entry
        return entry

    def hasher_of(self, ns_id: int) -> BlockHasher:
        """The block hasher of the namespace numbered ``ns_id``."""
        return self._by_id[ns_id]

    def ids_matching(self, lora: str | None, tenant: str | None) -> set[int]:
        """Ids of the namespaces with this LoRA and tenant (``None`` = any)."""
        return {
            i
            for i, ns in enumerate(self._namespaces)
            if (lora is None or ns.lora == lora) and (tenant is None or ns.tenant == tenant)
        }

    def hasher_of_chain(self, ev: BlockStored) -> tuple[BlockHasher, int]:
        """The hasher and namespace id of a chain that ``ev`` starts."""
        return self.hasher(*chain_fields(ev.lora_name, ev.extra_keys))


def chain_fields(lora_name: str | None, extra_keys: list[Any] | None) -> tuple[str, str]:
    """The (LoRA, tenant) of a chain from its first event's ``lora_name`` and ``extra_keys``."""
    lora = lora_name or ""
    first: Any = extra_keys
    if extra_keys and (extra_keys[0] is None or isinstance(extra_keys[0], list | tuple)):
        # One entry per block (vLLM's newer form): the tenant salt sits in block 0's keys.
        first = extra_keys[0]
    tenant = ""
    for item in first or ():
        if isinstance(item, str) and item != lora:
            tenant = item
    return lora, tenant
