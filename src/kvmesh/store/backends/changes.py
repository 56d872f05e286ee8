"""What a backend call changed: the keys it stored and the keys it dropped, for one listener.

The tiers private to one process (``memory``, ``disk``) decide their own evictions, so only they can
say when a chunk leaves. They carry an ``on_change`` attribute (:class:`Watchable`, outside the
:class:`~kvmesh.store.backends.base.Backend` protocol): ``None`` by default, which costs nothing;
set, it hears the net effect of every call that changed what the backend holds (``aclose``
excepted: the backend is gone)::

    room for two chunks, holding [x]
    put_many([a, b])      x evicted for b                 → stored [a, b], removed [x]
    put_many([c, d, e])   a, b evicted; c evicted for e   → stored [d, e], removed [a, b]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeAlias, runtime_checkable

from kvmesh.store.keys import StoreKey

ChunksChanged: TypeAlias = Callable[[list[StoreKey], list[StoreKey]], None]
"""``(stored, removed)``: the keys one call wrote and the backend holds at its end (an overwritten key
included), and the keys it held before the call and no longer holds (evicted, deleted, found gone).
A key written and evicted within the call is in neither. Called on the event loop; must not raise."""


@runtime_checkable
class Watchable(Protocol):
    """A backend that reports what it stores and drops."""

    on_change: ChunksChanged | None
    """The listener; ``None`` when nobody listens."""


class ChangeLog:
    """Net changes of one backend call, reported once at its end."""

    __slots__ = ("_held_before", "_held_now")

    def __init__(self) -> None:
        self._held_before: dict[StoreKey, bool] = {}
        self._held_now: dict[StoreKey, bool] = {}

    def wrote(self, key: StoreKey, *, held_before: bool) -> None:
        """``key`` is held now; ``held_before``: it was held when the call began (an overwrite)."""
        self._held_before.setdefault(key, held_before)
        self._held_now[key] = True

    def dropped(self, key: StoreKey) -> None:
        """``key`` is no longer held (only a held key can be dropped)."""
        self._held_before.setdefault(key, True)
        self._held_now[key] = False

    def report(self, listener: ChunksChanged | None) -> None:
        """Tell ``listener`` the net changes, if there are any."""
        if listener is None:
            return
        stored = [key for key, now in self._held_now.items() if now]
        removed = [key for key, now in self._held_now.items() if not now and self._held_before[key]]
        if stored or removed:
            listener(stored, removed)
