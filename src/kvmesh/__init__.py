"""kvmesh: one cluster-wide KV cache for a fleet of LLM replicas."""

from kvmesh.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace
from kvmesh.core.types import BlockKey, Medium, PodId
from kvmesh.errors import KVMeshError

__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "BlockHasher",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "HashAlgo",
    "KVEventBatch",
    "KVMeshError",
    "Medium",
    "Namespace",
    "PodId",
    "__version__",
    "decode_batch",
    "encode_batch",
]
