"""A workload with its token ids shifted, so that runs on one fleet do not hit each other's caches."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvmesh.workload.spec import RequestSpec, Stage, Workload
from kvmesh.workload.synthetic import DEFAULT_TOKEN_LOW, DEFAULT_VOCAB_SIZE, check_token_range


@dataclass(slots=True)
class ShiftedTokens:
    """Another workload with every prompt token id shifted by ``offset`` (modulo the id range).

    Lengths, order, arrival times and reusable prefixes are unchanged, but no block of the shifted
    stream equals a block of the original: runs that must not hit each other's caches use different
    offsets. ``messages`` are passed through unchanged.
    """

    inner: Workload
    offset: int
    vocab_size: int = DEFAULT_VOCAB_SIZE
    token_low: int = DEFAULT_TOKEN_LOW
    name: str = ""
    stages: list[Stage] | None = None

    def __post_init__(self) -> None:
        check_token_range(self.vocab_size, self.token_low)
        self.name = self.name or self.inner.name
        self.stages = self.stages or getattr(self.inner, "stages", None)

    def requests(self) -> Iterator[RequestSpec]:
        span = self.vocab_size - self.token_low
        low = self.token_low
        for spec in self.inner.requests():
            spec.prompt_token_ids = [low + (t - low + self.offset) % span for t in spec.prompt_token_ids]
            spec.prompt_blocks = None
            yield spec


def shifted(workload: Workload, offset: int) -> Workload:
    """``workload`` with token ids shifted by ``offset`` (itself when ``offset`` is 0); the id range is
    taken from the workload's ``vocab_size``/``token_low`` when it has them."""
    if offset == 0:
        return workload
    return ShiftedTokens(
        workload,
        offset,
        vocab_size=getattr(workload, "vocab_size", DEFAULT_VOCAB_SIZE),
        token_low=getattr(workload, "token_low", DEFAULT_TOKEN_LOW),
    )
