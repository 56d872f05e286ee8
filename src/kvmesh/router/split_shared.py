"""The fleet's shared-tier holder when router workers split event ingestion: any pod's events may
move blocks there, so every worker writes it, and a key stays while any worker still announces it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvmesh.core.types import BlockKey, Medium
from kvmesh.router.index import ALL_MEDIA, MEDIUM_BITS, SHARED_TIER_HOLDER, BlockIndex, MediumSet

_SHARED_BIT = MEDIUM_BITS[Medium.SHARED]


class SharedHolderKeys:
    """The shared-tier holder's keys, counted per worker that announced them.

    Args:
        index: where the holder's keys go.
    """

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self._by_origin: dict[int, set[BlockKey]] = {}
        self._num_origins: dict[BlockKey, int] = {}

    def keys_of(self, origin: int) -> set[BlockKey]:
        """The keys ``origin`` announced and has not removed."""
        return set(self._by_origin.get(origin, ()))

    def add(self, origin: int, keys: Sequence[BlockKey], media: MediumSet) -> None:
        mine = self._by_origin.setdefault(origin, set())
        counts = self._num_origins
        for key in keys:
            if key not in mine:
                mine.add(key)
                counts[key] = counts.get(key, 0) + 1
        self.index.add(keys, SHARED_TIER_HOLDER, media)

    def remove(self, origin: int, keys: Iterable[BlockKey], media: MediumSet = ALL_MEDIA) -> int:
        if not media & _SHARED_BIT:
            return 0
        mine = self._by_origin.get(origin)
        if not mine:
            return 0
        counts = self._num_origins
        gone: list[BlockKey] = []
        for key in keys:
            if key in mine:
                mine.discard(key)
                left = counts[key] - 1
                if left:
                    counts[key] = left
                else:
                    del counts[key]
                    gone.append(key)
        if gone:
            self.index.remove(gone, SHARED_TIER_HOLDER, media)
        return len(gone)

    def clear(self, origin: int) -> int:
        return self.remove(origin, list(self._by_origin.get(origin, ())))
