"""Formats that cross process boundaries: identities, block keys, KV events and their transport.

Every pillar (store, engine, router) depends on this package and on nothing of each other.

The names below are the pure formats (no sockets, no model files). The rest lives in its own module:
``event_transport`` (ZMQ publisher and subscriber), ``vllm_hashing`` (vLLM's own block hashes),
``models`` (SmolLM2 from its GGUF, the tiny random Llama), ``tokens`` (tokenizers) and ``net``
(loopback ports).
"""

from kvmesh.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from kvmesh.core.hashing import DEFAULT_BLOCK_SIZE, DEFAULT_CHUNK_SIZE, BlockHasher, HashAlgo, Namespace
from kvmesh.core.shared_writes import PromptBlocks, SharedWriteAnnouncer, shared_stored_event
from kvmesh.core.types import EMPTY_BLOCK_KEY, BlockKey, ExternalBlockHash, Medium, PodId, TokenIds

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CHUNK_SIZE",
    "EMPTY_BLOCK_KEY",
    "AllBlocksCleared",
    "BlockHasher",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "ExternalBlockHash",
    "HashAlgo",
    "KVEvent",
    "KVEventBatch",
    "Medium",
    "Namespace",
    "PodId",
    "PromptBlocks",
    "SharedWriteAnnouncer",
    "TokenIds",
    "decode_batch",
    "encode_batch",
    "shared_stored_event",
]
