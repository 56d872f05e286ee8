"""Token-level store API: what an engine calls to find, load and save prefix KV.

A prompt's tokens are cut into chunks of ``chunk_size`` tokens; chunk ``i`` is keyed by the chain
value at its last block (:meth:`kvmesh.core.hashing.BlockHasher.chunk_keys` over the store
namespace), so a chunk's key names its whole prefix. KV crosses this API as one array shaped
``(L, 2, H, T, D)`` (float32, float16, or bfloat16 carried as uint16 bit patterns)::

    tokens   | chunk 0 (chunk_size) | chunk 1 | chunk 2 | partial |
    store    |   kv[..., 0:C, :]    |  ...    |  ...    | (never) |

Every method is a coroutine for the engine's event loop: tier I/O happens in worker threads or
over asyncio sockets, writes to slow tiers are queued, and a failing tier yields misses, never
exceptions. Only caller misuse (a KV array of the wrong shape) raises ``ValueError``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeAlias

import numpy as np

from kvmesh.core.hashing import BlockHasher, HashAlgo, Namespace
from kvmesh.store.backends.base import ChunkData
from kvmesh.store.backends.changes import Watchable
from kvmesh.store.backends.memory import MemoryBackend
from kvmesh.store.codec import kv_dtype_name
from kvmesh.store.config import PIN_TIERS, StoreConfig, resolve_config
from kvmesh.store.factory import LOCAL_TIERS, build_store
from kvmesh.store.keys import StoreKey, namespace_group
from kvmesh.store.metrics import StoreMetrics
from kvmesh.store.pins import PinOutcome
from kvmesh.store.tiered import FoundChunk, TieredStore, TierWritten

_ENCODE_IN_THREAD_BYTES = 1 << 20
_MAX_HASHERS = 1024

PrefixWritten: TypeAlias = Callable[[str, int], None]
"""``(tier name, end)``: a tier now holds the chunks of ``tokens[0:end]`` that one
:meth:`KVCacheEngine.store` wrote there or found there. Chunks before the written ones are assumed
held (written by an earlier store), as a prefix lookup assumes. Called on the event loop; must not
raise."""

TierChanged: TypeAlias = Callable[[str, list[StoreKey], list[StoreKey]], None]
"""``(tier name, stored, removed)``: the chunks one call to that tier wrote and dropped (see
:data:`~kvmesh.store.backends.changes.ChunksChanged`). Called on the event loop; must not raise."""


def check_prompt_kv(kv: np.ndarray, num_tokens: int) -> None:
    """Raise ``ValueError`` unless ``kv`` is the KV of leading tokens of a ``num_tokens`` prompt:
    shaped (L, 2, H, T, D) with T <= ``num_tokens``."""
    if kv.ndim != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be shaped (L, 2, H, T, D), got {kv.shape}")
    if kv.shape[3] > num_tokens:
        raise ValueError(
            f"kv covers {kv.shape[3]} tokens but only {num_tokens} were given: (L, 2, H, T, D) needs T <= {num_tokens}"
        )


@dataclass(frozen=True, slots=True)
class RetrieveResult:
    """KV of the longest stored prefix.

    ``kv`` is a fresh writable array shaped (L, 2, H, num_tokens, D), ``None`` when nothing was
    found; ``tier`` is the slowest tier that served part of it ("cpu", "disk", "redis", "fs").
    A retrieve with ``join=False`` leaves ``kv`` ``None`` and returns the chunks in ``parts`` instead
    (read-only views of what the tiers returned, in token order), for a caller that moves them
    somewhere else anyway (a GPU) and would only pay for the host-side join.
    """

    num_tokens: int
    kv: np.ndarray | None
    tier: str | None
    parts: tuple[np.ndarray, ...] = ()
    held_tokens: int = 0
    """Leading tokens the tiers said they held (more than ``num_tokens``: a chunk failed its checks
    or its tier failed in between; held but not read when no more than ``beyond``)."""

    @classmethod
    def miss(cls, held_tokens: int = 0) -> RetrieveResult:
        return cls(0, None, None, (), held_tokens)


class KVCacheEngine:
    """Chunked prefix KV over a :class:`~kvmesh.store.tiered.TieredStore`.

    Args:
        store: the tiers.
        config: chunking, hashing and default KV format.
    """

    def __init__(self, store: TieredStore, config: StoreConfig) -> None:
        self.tiered = store
        self.config = config
        self.chunk_size = config.chunk_size
        self.block_size = config.block_size
        self.hash_algo = HashAlgo(config.hash_algo)
        self.kv_dtype = config.kv_dtype
        self.kv_layout = config.kv_layout
        self.pin_budgets = config.pin_budgets()
        self.pin_max_ttl_s = config.pin_max_ttl_s
        self._hashers: dict[Namespace, BlockHasher] = {}

    @classmethod
    def from_config(
        cls, config: StoreConfig | str | os.PathLike[str] | None, *, metrics: StoreMetrics | None = None
    ) -> KVCacheEngine:
        """Build from a config, a YAML path, a URL shorthand ("memory", "redis://…", "valkey://…",
        "file:///dir"), or ``None`` (a RAM tier, plus ``KVMESH_*`` overrides).

        Raises:
            ConfigError: an invalid configuration.
        """
        resolved = resolve_config(config)
        return cls(build_store(resolved, metrics), resolved)

    @property
    def metrics(self) -> StoreMetrics:
        return self.tiered.metrics

    def bind_layout(self, kv_dtype: str, kv_layout: str) -> None:
        """Set the KV format used for namespaces that do not name one (the engine's model)."""
        self.kv_dtype = kv_dtype
        self.kv_layout = kv_layout
        self._hashers.clear()

    def _hasher(self, namespace: Namespace) -> BlockHasher:
        hasher = self._hashers.get(namespace)
        if hasher is None:
            store_ns = namespace if namespace.kv_dtype else namespace.for_store(self.kv_dtype, self.kv_layout)
            if len(self._hashers) >= _MAX_HASHERS:
                self._hashers.clear()
            hasher = BlockHasher(store_ns, block_size=self.block_size, algo=self.hash_algo)
            self._hashers[namespace] = hasher
        return hasher

    def chunk_keys(
        self, tokens: Sequence[int], namespace: Namespace, max_chunks: int | None = None
    ) -> list[StoreKey]:
        """Store keys of the full chunks of ``tokens``."""
        n_chunks = len(tokens) // self.chunk_size
        if max_chunks is not None:
            n_chunks = min(n_chunks, max_chunks)
        if n_chunks <= 0:
            return []
        hasher = self._hasher(namespace)
        group = namespace_group(namespace)
        keys = hasher.chunk_keys(tokens[: n_chunks * self.chunk_size], self.chunk_size)
        return [StoreKey(group, k) for k in keys]

    async def lookup(self, tokens: Sequence[int], namespace: Namespace) -> int:
        """Prefix tokens the tiers hold (a multiple of ``chunk_size``); reads no payload."""
        keys = self.chunk_keys(tokens, namespace)
        if not keys:
            return 0
        return await self.tiered.count_prefix(keys) * self.chunk_size

    async def retrieve(
        self,
        tokens: Sequence[int],
        namespace: Namespace,
        max_tokens: int | None = None,
        *,
        join: bool = True,
        keys: Sequence[StoreKey] | None = None,
        beyond: int = 0,
        read_extra_s: float | None = None,
    ) -> RetrieveResult:
        """Load the KV of the longest stored prefix of ``tokens``: one existence check per tier,
        then one read per chunk.

        Args:
            tokens: the prompt.
            namespace: model, revision, LoRA, tenant (KV format from :meth:`bind_layout` if unset).
            max_tokens: load at most this many tokens (rounded down to whole chunks).
            join: concatenate the chunks into ``kv``; ``False`` returns them as ``parts``.
            keys: ``tokens``' chunk keys from :meth:`chunk_keys` (at least those of the chunks to
                load), when the caller has them already; computed here otherwise.
            beyond: load nothing unless the stored prefix is longer than this many tokens (the
                caller holds those); the miss then carries ``held_tokens``.
            read_extra_s: how long a tier read may outlast the tier's timeout (``None``: by its
                size; see :meth:`TieredStore.get_prefix`).

        Returns:
            The prefix KV; a miss (0 tokens) when nothing usable was found.
        """
        max_chunks = len(tokens) // self.chunk_size
        if max_tokens is not None:
            max_chunks = min(max_chunks, max(0, max_tokens) // self.chunk_size)
        if keys is None:
            keys = self.chunk_keys(tokens, namespace, max_chunks)
        elif len(keys) < max_chunks:
            raise ValueError(f"{len(keys)} chunk keys given for {max_chunks} chunks of {len(tokens)} tokens")
        keys = keys[:max_chunks]
        if not keys:
            return RetrieveResult.miss()
        result = await self.tiered.get_prefix(
            keys, beyond=max(0, beyond) // self.chunk_size, read_extra_s=read_extra_s
        )
        held_tokens = result.num_held * self.chunk_size
        chunks = self._consistent_prefix(result.chunks)
        if not chunks:
            return RetrieveResult.miss(held_tokens)
        arrays = [c.chunk.kv for c in chunks]
        order = {t.name: n for n, t in enumerate(self.tiered.tiers)}
        slowest = max((c.tier for c in chunks), key=lambda name: order.get(name, 0))
        if not join:
            return RetrieveResult(sum(a.shape[3] for a in arrays), None, slowest, tuple(arrays), held_tokens)
        total = sum(a.nbytes for a in arrays)
        if total > _ENCODE_IN_THREAD_BYTES:
            kv = await asyncio.to_thread(np.concatenate, arrays, 3)
        else:
            kv = np.concatenate(arrays, axis=3)
        return RetrieveResult(kv.shape[3], kv, slowest, (), held_tokens)

    def _consistent_prefix(self, found: list[FoundChunk]) -> list[FoundChunk]:
        """Leading chunks that are whole chunks of one KV format (a chunk written with another
        ``chunk_size`` can share a key at a common boundary; it ends the prefix)."""
        out: list[FoundChunk] = []
        for item in found:
            header = item.chunk.header
            shape = header.shape
            if header.num_tokens != self.chunk_size:
                break
            if out:
                first = out[0].chunk.header
                if (first.dtype, first.shape[:3], first.shape[4]) != (header.dtype, shape[:3], shape[4]):
                    break
            elif self.kv_dtype and header.dtype != self.kv_dtype:
                break
            out.append(item)
        return out

    async def store(
        self,
        tokens: Sequence[int],
        namespace: Namespace,
        kv: np.ndarray,
        *,
        skip_tokens: int = 0,
        on_written: PrefixWritten | None = None,
        every_tier: bool = False,
        keys: Sequence[StoreKey] | None = None,
    ) -> None:
        """Save the full chunks of ``kv``, which covers ``tokens[0:kv.shape[3]]``.

        Chunks that end within the first ``skip_tokens`` tokens, and chunks the fastest tier
        already holds, are skipped (with ``every_tier``, only chunks each tier itself holds: a
        prompt about to be pinned must reach the shared tiers). The RAM tier is written before this returns; slower tiers are
        written by background workers (a full queue drops the write and counts it).

        Args:
            tokens: the prompt.
            namespace: model, revision, LoRA, tenant (KV format from :meth:`bind_layout` if unset).
            kv: KV of the leading tokens, (L, 2, H, T, D).
            skip_tokens: leading tokens known to be stored already.
            on_written: told, once per tier whose write succeeded (possibly later, from the tier's
                worker), how far the prompt now reaches in that tier. A tier that dropped the write
                is not reported; when the fastest tier held every chunk, only it is reported.
            keys: ``tokens``' chunk keys from :meth:`chunk_keys` (at least those ``kv`` covers),
                when the caller has them already; computed here otherwise.

        Raises:
            ValueError: ``kv`` is not (L, 2, H, T, D) with T ≤ len(tokens), its dtype disagrees
                with the bound KV dtype, or ``keys`` are fewer than its chunks.
        """
        check_prompt_kv(kv, len(tokens))
        dtype = kv_dtype_name(kv)
        if self.kv_dtype and dtype != self.kv_dtype:
            raise ValueError(f"kv dtype is {dtype} but the store is bound to {self.kv_dtype}")
        num_chunks = kv.shape[3] // self.chunk_size
        if keys is None:
            keys = self.chunk_keys(tokens[: kv.shape[3]], namespace)
        elif len(keys) < num_chunks:
            raise ValueError(f"{len(keys)} chunk keys given for the {num_chunks} chunks kv covers")
        else:
            keys = list(keys[:num_chunks])
        first = max(0, skip_tokens) // self.chunk_size
        todo = list(range(first, len(keys)))
        if not todo:
            return
        held = (
            [False] * len(todo)
            if every_tier
            else await self.tiered.held_by_first_tier([keys[i] for i in todo])
        )
        all_held = all(held)
        todo = [i for i, h in zip(todo, held, strict=True) if not h]
        if not todo:
            if on_written is not None and all_held and first == 0 and self.tiered.tiers:
                on_written(self.tiered.tiers[0].name, len(keys) * self.chunk_size)
            return
        codec = self.tiered.codec
        c = self.chunk_size

        fastest = self.tiered.tiers[0].backend if self.tiered.tiers else None
        into = fastest.buffers.take if isinstance(fastest, MemoryBackend) else None

        def encode() -> list[tuple[StoreKey, ChunkData]]:
            return [
                (keys[i], codec.encode(keys[i], kv[:, :, :, i * c : (i + 1) * c, :], dtype, into=into))
                for i in todo
            ]

        if kv.nbytes * len(todo) // max(1, len(keys)) > _ENCODE_IN_THREAD_BYTES:
            items = await asyncio.to_thread(encode)
        else:
            items = encode()
        if on_written is None:
            await self.tiered.put(items)
            return
        # Each tier confirms the chunks this put leaves out, so a report never claims a chunk
        # that tier lacks (one the fastest tier kept and a slower one dropped or evicted).
        written = set(todo)
        vouch = [key for i, key in enumerate(keys) if i not in written]
        await self.tiered.put(items, self._prefix_reporter(keys, on_written), vouch)

    def _prefix_reporter(self, keys: Sequence[StoreKey], on_written: PrefixWritten) -> TierWritten:
        """Turn a tier's "these keys are held" into "the prompt is held up to token ``end``": the
        run of chunks from the prompt's start it holds (a reader's prefix lookup stops at a gap)."""
        position = {key: i for i, key in enumerate(keys)}

        def report(tier: str, held: list[StoreKey]) -> None:
            have = {position[key] for key in held}
            run = 0
            while run in have:
                run += 1
            if run:
                on_written(tier, run * self.chunk_size)

        return report

    def can_pin(self, tenant: str) -> bool:
        """Whether some tier of this store can pin and gives ``tenant`` a budget there."""
        return any(
            self.pin_budgets.bytes_for(tenant, tier.name) > 0 and tier.name in PIN_TIERS
            for tier in self.tiered.tiers
        )

    async def pin(
        self,
        tokens: Sequence[int],
        namespace: Namespace,
        ttl_s: float,
        *,
        estimate_chunk_bytes: int | None = None,
    ) -> dict[str, PinOutcome | None]:
        """Pin the full chunks of ``tokens`` in the shared tiers for ``ttl_s`` seconds.

        Each tier pins after the writes queued before this call, within ``namespace.tenant``'s
        budget there (:attr:`pin_budgets`); a tier without a budget for the tenant is not asked.

        Args:
            tokens: the prompt.
            namespace: model, revision, LoRA, tenant.
            ttl_s: seconds (≤ :attr:`pin_max_ttl_s`).
            estimate_chunk_bytes: check only (nothing is pinned), counting a chunk a tier lacks
                at this size.

        Returns:
            Per tier asked, its outcome (``None``: the tier failed; pins there are lost, as
            writes are).

        Raises:
            ValueError: ``ttl_s`` is not in (0, :attr:`pin_max_ttl_s`].
        """
        if not 0 < ttl_s <= self.pin_max_ttl_s:
            raise ValueError(f"pin ttl_s must be in (0, {self.pin_max_ttl_s}], got {ttl_s}")
        keys = self.chunk_keys(tokens, namespace)
        if not keys:
            return {}
        tenant = namespace.tenant
        budgets = {name: self.pin_budgets.bytes_for(tenant, name) for name in PIN_TIERS}
        return await self.tiered.pin(keys, tenant, ttl_s, budgets, estimate_bytes=estimate_chunk_bytes)

    def watch_local_tiers(self, listener: TierChanged | None) -> list[str]:
        """Tell ``listener`` which chunks the tiers private to this process (RAM, local disk) store
        and drop, evictions included; ``None`` stops telling. Tiers other processes share are not
        watched: they evict without this process knowing.

        Returns:
            The names of the tiers watched, fastest first (empty: no local tier).
        """
        watched: list[str] = []
        for tier in self.tiered.tiers:
            backend = tier.backend
            if tier.name in LOCAL_TIERS and isinstance(backend, Watchable):
                backend.on_change = None if listener is None else partial(listener, tier.name)
                watched.append(tier.name)
        return watched

    async def flush(self, namespace: Namespace | None = None, *, local_only: bool = False) -> int:
        """Delete every chunk of ``namespace``'s model, revision and LoRA (all tenants and KV
        formats), or every chunk when ``None``; returns chunks removed over reachable tiers.

        ``local_only`` empties only this process's own tiers (RAM and local disk), leaving the
        tiers other engines share untouched.
        """
        group = None if namespace is None else namespace_group(namespace)
        local = [t.name for t in self.tiered.tiers if t.name in LOCAL_TIERS] if local_only else None
        removed = await self.tiered.flush(group, local)
        return sum(n for n in removed.values() if n is not None)

    async def drain(self) -> None:
        """Wait for queued writes to be attempted (tests, tools, orderly shutdown)."""
        await self.tiered.drain()

    def stats(self) -> dict[str, object]:
        """Counters, breaker states and sizes known without I/O."""
        tiers = {
            s.name: {
                **s.counters.to_dict(),
                "breaker": ("closed", "half_open", "open")[s.breaker_state],
                "queue_bytes": s.queue_bytes,
                "num_bytes": s.num_bytes,
                "num_evictions": s.num_evictions,
            }
            for s in self.tiered.snapshots()
        }
        return {
            "chunk_size": self.chunk_size,
            "codec": self.tiered.codec.codec.value,
            "lookup_chunks": self.tiered.num_lookup_chunks,
            "lookup_hit_chunks": self.tiered.num_lookup_hit_chunks,
            "tiers": tiers,
        }

    async def aclose(self) -> None:
        """Finish queued writes (bounded wait) and close every tier."""
        await self.tiered.aclose()
