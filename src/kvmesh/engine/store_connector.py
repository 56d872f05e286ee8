"""The engine's view of the KV store: longest stored prefix, load it, write new chunks back.

The scheduler talks to a :class:`PrefixStore`; :class:`NullPrefixStore` (no store) is the default and
:class:`CacheEngineStore` adapts :class:`kvmesh.store.cache_engine.KVCacheEngine`. A store that is
slow or down answers with misses (the store's own contract), so the engine recomputes instead of
failing the request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np

from kvmesh.core.hashing import Namespace
from kvmesh.core.types import Medium
from kvmesh.engine.pins import PinResult

if TYPE_CHECKING:
    from kvmesh.store.keys import StoreKey


@dataclass(frozen=True, slots=True)
class LoadedPrefix:
    """KV of a stored prefix, (L, 2, H, num_tokens, D); ``tier`` names where it came from.

    From the store it arrives as ``parts`` (the chunks, numpy, in token order) with ``kv`` ``None``;
    the engine joins them in the runner's form (:meth:`~kvmesh.engine.runner.KVOps.join_host`: on
    a GPU straight into device memory) before admission. A store may also hand over ``kv`` joined.
    """

    num_tokens: int
    kv: Any
    tier: str
    parts: tuple[np.ndarray, ...] = ()
    held_tokens: int = 0
    """Leading tokens the store's tiers said they held; more than ``num_tokens`` when a chunk
    failed its checks or its tier failed before it was read (the request is marked a store fault)."""


StoreWritten: TypeAlias = Callable[[Medium, int], None]
"""``(medium, end)``: a store tier of this medium now holds the prompt's chunks up to token ``end``.
Called on the event loop, possibly after :meth:`PrefixStore.store` returned; must not raise."""

LocalTierChanged: TypeAlias = Callable[[Medium, "list[StoreKey]", "list[StoreKey]"], None]
"""``(medium, stored, removed)``: a store tier only this engine reads (RAM: CPU, local disk: DISK)
now holds the chunks ``stored`` and no longer holds ``removed`` (evicted or deleted). Called on the
event loop, from inside a store call or a tier's background writer; must not raise."""


@dataclass(frozen=True, slots=True)
class LocalTiers:
    """The store tiers only this engine reads, as :meth:`PrefixStore.watch_local_tiers` watches them."""

    media: tuple[Medium, ...]
    """The watched tiers' media, fastest first."""
    chunk_keys: Callable[[list[int], str], list[StoreKey]]
    """``(tokens, tenant)`` → the keys of the full chunks of ``tokens``, as the reports name them."""


@dataclass(frozen=True, slots=True)
class PromptWrite:
    """A prompt's KV on its way to the store."""

    tokens: list[int]
    tenant: str
    kv: np.ndarray
    """KV of ``tokens``, (L, 2, H, len(tokens), D)."""
    skip_tokens: int = 0
    """Leading tokens known to be stored already: their chunks are not written."""
    on_written: StoreWritten | None = None
    """Hears once per tier that took the write (or already held it); never for a tier that dropped it."""
    every_tier: bool = False
    """Write each tier what it lacks, even when the fastest tier holds the chunks (a prompt about to
    be pinned)."""
    keys: list[StoreKey] | None = None
    """The prompt's :meth:`PrefixStore.store_keys`, when the caller has them."""


class PrefixStore(Protocol):
    """Token-level store access for one model and KV layout."""

    chunk_size: int

    def store_keys(self, tokens: list[int], tenant: str) -> list[StoreKey]:
        """Keys of the full chunks of ``tokens``: computed once per request, passed to the calls below."""
        ...

    async def retrieve(
        self, tokens: list[int], tenant: str, keys: list[StoreKey], beyond: int = 0
    ) -> LoadedPrefix | None:
        """Load the longest stored prefix of ``tokens`` (``keys``: their :meth:`store_keys`) if it
        is longer than ``beyond`` tokens; ``None`` when nothing was held, a ``LoadedPrefix`` of 0
        tokens carrying ``held_tokens`` when nothing was read."""
        ...

    async def store(self, write: PromptWrite) -> None:
        """Write the chunks of ``write.tokens`` past ``write.skip_tokens`` the store lacks (see
        :class:`PromptWrite`)."""
        ...

    def pin_max_ttl_s(self, tenant: str) -> float | None:
        """The longest pin ``tenant`` may ask for; ``None`` when it has no pin budget here."""
        ...

    async def pin(
        self, tokens: list[int], tenant: str, ttl_s: float, *, check: bool = False
    ) -> list[PinResult]:
        """Pin the full chunks of ``tokens`` in the tiers that give ``tenant`` a pin budget, after
        the writes issued before; ``check``: only say whether it would fit (chunks not yet written
        counted at the store's chunk size). A tier that failed is left out of the answer."""
        ...

    async def drain(self) -> None:
        """Wait until queued writes reached every tier (P/D: the decode side must find them)."""
        ...

    async def reset_local(self) -> int:
        """Empty the tiers only this engine reads (RAM, local disk); returns chunks removed."""
        ...

    def watch_local_tiers(self, listener: LocalTierChanged) -> LocalTiers | None:
        """Tell ``listener`` what the tiers only this engine reads store and drop; ``None`` when
        the store has no such tier (nothing is watched)."""
        ...

    async def aclose(self) -> None: ...


class NullPrefixStore:
    """No store: every lookup misses and writes go nowhere."""

    chunk_size = 256

    def store_keys(self, tokens: list[int], tenant: str) -> list[StoreKey]:
        return []

    async def retrieve(
        self, tokens: list[int], tenant: str, keys: list[StoreKey], beyond: int = 0
    ) -> LoadedPrefix | None:
        return None

    async def store(self, write: PromptWrite) -> None:
        return None

    def pin_max_ttl_s(self, tenant: str) -> float | None:
        return None

    async def pin(
        self, tokens: list[int], tenant: str, ttl_s: float, *, check: bool = False
    ) -> list[PinResult]:
        return []

    async def drain(self) -> None:
        return None

    async def reset_local(self) -> int:
        return 0

    def watch_local_tiers(self, listener: LocalTierChanged) -> LocalTiers | None:
        return None

    async def aclose(self) -> None:
        return None


class CacheEngineStore:
    """Adapter over ``KVCacheEngine`` for one base namespace; tenants salt it.

    Store tier names ("cpu", "disk", "redis", "fs") are reported as media (CPU, DISK, SHARED).

    Args:
        engine: a ``kvmesh.store.cache_engine.KVCacheEngine``.
        namespace: the model's namespace (model, revision); the KV format is added by the store.
    """

    def __init__(self, engine: Any, namespace: Namespace) -> None:
        self._engine = engine
        self._namespace = namespace
        self.chunk_size: int = int(engine.chunk_size)

    def _ns(self, tenant: str) -> Namespace:
        return self._namespace.for_tenant(tenant)

    def store_keys(self, tokens: list[int], tenant: str) -> list[StoreKey]:
        return list(self._engine.chunk_keys(tokens, self._ns(tenant)))

    async def retrieve(
        self, tokens: list[int], tenant: str, keys: list[StoreKey], beyond: int = 0
    ) -> LoadedPrefix | None:
        result = await self._engine.retrieve(tokens, self._ns(tenant), join=False, keys=keys, beyond=beyond)
        held = int(result.held_tokens)
        if result.num_tokens <= 0 or not result.parts:
            return LoadedPrefix(0, None, Medium.GPU.value, (), held) if held else None
        return LoadedPrefix(int(result.num_tokens), None, Medium.parse(result.tier).value, result.parts, held)

    async def store(self, write: PromptWrite) -> None:
        report = None if write.on_written is None else _by_medium(write.on_written)
        await self._engine.store(
            write.tokens,
            self._ns(write.tenant),
            write.kv,
            skip_tokens=write.skip_tokens,
            on_written=report,
            every_tier=write.every_tier,
            keys=write.keys,
        )

    def pin_max_ttl_s(self, tenant: str) -> float | None:
        return float(self._engine.pin_max_ttl_s) if self._engine.can_pin(tenant) else None

    async def pin(
        self, tokens: list[int], tenant: str, ttl_s: float, *, check: bool = False
    ) -> list[PinResult]:
        estimate = int(self._engine.tiered.chunk_bytes) if check else None
        outcomes = await self._engine.pin(tokens, self._ns(tenant), ttl_s, estimate_chunk_bytes=estimate)
        return [
            PinResult(o.tier, o.accepted, o.expires_at, o.refusal(tenant), o.over_budget)
            for o in outcomes.values()
            if o is not None
        ]

    async def drain(self) -> None:
        await self._engine.drain()

    async def reset_local(self) -> int:
        return int(await self._engine.flush(None, local_only=True))

    def watch_local_tiers(self, listener: LocalTierChanged) -> LocalTiers | None:
        def report(tier: str, stored: list[StoreKey], removed: list[StoreKey]) -> None:
            listener(Medium.parse(tier), stored, removed)

        names: list[str] = self._engine.watch_local_tiers(report)
        if not names:
            return None
        return LocalTiers(tuple(Medium.parse(name) for name in names), self.store_keys)

    async def aclose(self) -> None:
        close = getattr(self._engine, "aclose", None)
        if close is not None:
            await close()


def _by_medium(on_written: StoreWritten) -> Callable[[str, int], None]:
    """Report store tier names ("cpu", "redis", "fs", ...) as media."""

    def report(tier: str, end: int) -> None:
        on_written(Medium.parse(tier), end)

    return report


_null: PrefixStore = NullPrefixStore()
