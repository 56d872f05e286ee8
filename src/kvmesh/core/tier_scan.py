"""One pass of a prompt's store chunks through the KV tiers below the device, fastest tier first.

The store (:class:`kvmesh.store.tiered.TieredStore`) and the simulator
(:class:`kvmesh.sim.tiers.TierStack`) both find a stored prefix this way: each tier is asked once,
about the chunks no faster tier holds; a chunk is read from the fastest tier that holds it; the
prefix ends at the first chunk no tier holds. Only the asking differs (a backend's ``exists_many``
or a simulated cache), so the rule lives here, free of I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixScan:
    """Which tier serves each of ``num_chunks`` consecutive chunks of one prompt.

    Args:
        num_chunks: chunks asked about, from the prompt's start.

    Use: for each tier, fastest first, ask it about :meth:`unresolved` and :meth:`record` its
    answer; then :attr:`num_held` is the stored prefix and :meth:`served_by` what each tier serves.
    """

    __slots__ = ("holder",)

    def __init__(self, num_chunks: int) -> None:
        self.holder: list[int | None] = [None] * max(0, num_chunks)
        """Per chunk, the index of the fastest tier that holds it (``None``: none so far)."""

    def unresolved(self) -> list[int]:
        """Chunks no tier asked so far holds (what the next tier is asked about)."""
        return [i for i, h in enumerate(self.holder) if h is None]

    def record(self, tier: int, asked: Sequence[int], present: Iterable[bool]) -> None:
        """Tier number ``tier`` answered ``present[j]`` for chunk ``asked[j]``."""
        holder = self.holder
        for i, held in zip(asked, present, strict=True):
            if held and holder[i] is None:
                holder[i] = tier

    @property
    def num_held(self) -> int:
        """Leading chunks some tier holds: the stored prefix, in chunks."""
        n = 0
        holder = self.holder
        while n < len(holder) and holder[n] is not None:
            n += 1
        return n

    def served_by(self, tier: int, first: int = 0) -> list[int]:
        """Chunks of the stored prefix from ``first`` on whose fastest holder is ``tier``."""
        holder = self.holder
        return [i for i in range(first, self.num_held) if holder[i] == tier]
