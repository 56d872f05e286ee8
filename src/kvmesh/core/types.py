"""Identity types shared by every pillar.

Each identity gets its own type so a pod id is never passed where a block key is expected.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NewType, TypeAlias

BlockKey = NewType("BlockKey", bytes)
"""kvmesh's chained block key (16 bytes): ``h_i = H(h_{i-1} || tokens_i)``."""

EMPTY_BLOCK_KEY = BlockKey(b"")
"""The parent of the first block when no namespace seed applies (never a real key)."""

ExternalBlockHash: TypeAlias = int | bytes
"""An engine's own block hash as it travels in KV events: a u64 int or raw bytes. Opaque to us."""

PodId = NewType("PodId", str)
"""An endpoint's identity in the router and in events, e.g. ``"http://127.0.0.1:8001"``."""

TokenIds: TypeAlias = list[int]


class Medium(StrEnum):
    """Where a block lives. Values are the strings vLLM and LMCache put in ``medium``."""

    GPU = "GPU"
    CPU = "CPU"
    DISK = "DISK"
    SHARED = "SHARED"

    @classmethod
    def parse(cls, value: str | None) -> Medium:
        """Map a wire ``medium`` string to a tier; unknown or missing media count as GPU (vLLM's default)."""
        if not value:
            return cls.GPU
        upper = value.upper()
        for member in cls:
            if member.value == upper:
                return member
        if upper in {"LMCACHE", "REDIS", "VALKEY", "REMOTE", "FS", "NFS"}:
            return cls.SHARED
        if upper in {"CPU_PINNED", "HOST", "DRAM"}:
            return cls.CPU
        if upper in {"STORAGE", "SSD", "LOCAL_DISK"}:  # vLLM's offloading connectors say STORAGE
            return cls.DISK
        return cls.GPU
