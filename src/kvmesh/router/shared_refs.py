"""How many of the shared tier's engine blocks name each router key.

Publishers whose engine hashes differ (vLLM pods seeded apart, a mixed fleet) each announce the same
shared-tier block under their own engine hash, so one router key may be named by several entries of
the shared tier's holder; its index entry goes only when the last of them does.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.core.types import BlockKey


class SharedKeyRefs:
    """Router keys named by the shared tier's blocks, with a count only where more than one names a key.

    A set and a rare map of the names beyond the first instead of a count per key: a third of the memory.
    """

    __slots__ = ("_extra", "_named")

    def __init__(self) -> None:
        self._named: set[BlockKey] = set()
        self._extra: dict[BlockKey, int] = {}

    def clear(self) -> None:
        """Forget every key."""
        self._named.clear()
        self._extra.clear()

    def add(self, keys: Sequence[BlockKey]) -> None:
        """One more block names each of ``keys``."""
        named = self._named
        if named.isdisjoint(keys):
            named.update(keys)
            return
        extra = self._extra
        for key in keys:
            if key in named:
                extra[key] = extra.get(key, 0) + 1
            else:
                named.add(key)

    def release(self, keys: Sequence[BlockKey]) -> Sequence[BlockKey]:
        """One block fewer names each of ``keys``.

        Returns:
            The keys no block names any more (the ones to take out of the index).
        """
        named, extra = self._named, self._extra
        if not extra:
            named.difference_update(keys)
            return keys
        last: list[BlockKey] = []
        for key in keys:
            n = extra.get(key, 0)
            if n > 1:
                extra[key] = n - 1
            elif n:
                del extra[key]
            else:
                named.discard(key)
                last.append(key)
        return last
