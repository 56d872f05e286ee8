"""Which publishers vouch for each block of the shared tier's map.

When a publisher restarts (its event sequence resets), the router cannot tell which of its
shared-tier announcements still hold — the tier may have evicted them while no events flowed, or
lived in the process that restarted — so the blocks of the shared tier's map that no other
publisher announced are dropped. A pod that writes such a block again announces it again; a
dropped block the tier still holds is at worst a missed prefix credit, never a wrong one. A
publisher that leaves the fleet (scale-down) only withdraws its name: what it wrote to a shared
store stays there for every other pod, so its blocks stay in the map.

Publishers get small numbers, and each engine hash maps to a bit mask of them, so the cost is one
dict entry per shared block whatever the fleet's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvmesh.core.types import ExternalBlockHash, PodId

__all__ = ["SharedVouchers"]


class SharedVouchers:
    """Publisher bit masks per engine hash of the shared tier's map."""

    def __init__(self) -> None:
        self._bits: dict[PodId, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 1
        self._masks: dict[ExternalBlockHash, int] = {}

    def __len__(self) -> int:
        return len(self._masks)

    def vouch(self, pod: PodId, hashes: Iterable[ExternalBlockHash]) -> None:
        """``pod`` announced ``hashes`` in the shared tier."""
        bit = self._bits.get(pod)
        if bit is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._next_bit = self._next_bit, self._next_bit << 1
            self._bits[pod] = bit
        masks = self._masks
        for h in hashes:
            masks[h] = masks.get(h, 0) | bit

    def withdraw(
        self, pod: PodId, still_held: Callable[[ExternalBlockHash], bool], *, orphan: bool = True
    ) -> list[ExternalBlockHash]:
        """``pod`` restarted or left: forget its vouches.

        Args:
            pod: the publisher.
            still_held: whether the shared tier's map still tracks a hash; hashes it no longer
                tracks are forgotten on the way (they left the map by eviction or removal).
            orphan: return the hashes only ``pod`` vouched for (a restart); ``False`` forgets them
                without returning them (the pod left, the blocks stay).

        Returns:
            Hashes the map still tracks that no other publisher vouches for: the caller drops them.
        """
        bit = self._bits.pop(pod, None)
        if bit is None:
            return []
        self._free_bits.append(bit)  # no mask keeps it once this returns
        orphaned: list[ExternalBlockHash] = []
        masks = self._masks
        for h, mask in list(masks.items()):
            if not still_held(h):
                del masks[h]
            elif mask & bit:
                if mask == bit:
                    del masks[h]
                    if orphan:
                        orphaned.append(h)
                else:
                    masks[h] = mask & ~bit
        return orphaned

    def prune(self, still_held: Callable[[ExternalBlockHash], bool]) -> None:
        """Forget hashes the map no longer tracks (bounds memory between restarts)."""
        self._masks = {h: mask for h, mask in self._masks.items() if still_held(h)}

    def clear(self) -> None:
        """The shared tier's map was emptied."""
        self._masks.clear()
