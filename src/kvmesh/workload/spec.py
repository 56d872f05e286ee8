"""What a workload is: load stages, the request record, and the two workload protocols."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from kvmesh.errors import ConfigError
from kvmesh.workload.trace_blocks import PromptBlocks

Arrival = Literal["poisson", "constant"]


@dataclass(slots=True)
class Stage:
    """One load stage: ``rate`` requests per second for ``duration`` seconds.

    A ``warmup`` stage fills the fleet's caches; runs report it on its own row and leave it out of
    their headline summary, as llm-d's benchmarks do with their first stage.
    """

    rate: float
    duration: float
    warmup: bool = False

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.duration <= 0:
            raise ConfigError(
                f"stage needs rate > 0 and duration > 0, got rate={self.rate} duration={self.duration}"
            )


@dataclass(slots=True)
class RequestSpec:
    """One request of a workload."""

    request_id: str
    arrival_s: float
    """Seconds after the start of the run at which the request is due."""
    prompt_token_ids: list[int]
    """Read-only: workloads hand out one list per distinct prompt to every request that sends it."""
    output_len: int
    group: str | None = None
    session_id: str | None = None
    """Requests of one session are sent one after another (each after the previous one finished)."""
    stage: int = 0
    reusable_prefix_len: int = 0
    """Tokens of this prompt that an ideal fleet-wide cache could hold (shared with an earlier prompt)."""
    messages: list[dict[str, str]] | None = None
    """Chat form of the prompt, for workloads that are chat-shaped (text mode)."""
    prompt_id: int | None = None
    """Which of the workload's distinct prompts this is (equal ids, equal tokens); ``None`` if untracked."""
    prompt_blocks: PromptBlocks | None = None
    """The same prompt as a chain of shared token blocks (trace replays), for consumers that work
    block by block and need not hold the tokens (the simulator, through
    :meth:`BlockWorkload.block_requests`, where ``prompt_token_ids`` is left empty)."""
    gap_after_previous_s: float | None = None
    """Think time: the request is sent this many seconds after the previous request of its session
    finished (or at ``arrival_s`` if that is later). ``None``: sent at ``arrival_s``, or when the
    previous request of its session finished if that is later. Workloads that set it give later
    turns an ``arrival_s`` no later than any send time they can have (the session's start plus the
    gaps before them), so that ``arrival_s`` only orders the stream."""


class Workload(Protocol):
    """A named, deterministic stream of requests in arrival order."""

    name: str

    def requests(self) -> Iterator[RequestSpec]: ...


@runtime_checkable
class BlockWorkload(Workload, Protocol):
    """A workload whose prompts are chains of shared token blocks (trace replays)."""

    def block_requests(self) -> Iterator[RequestSpec]:
        """The stream of :meth:`requests` without token lists: each prompt is only in
        ``prompt_blocks`` and ``prompt_token_ids`` is empty (for consumers that read blocks)."""
        ...


def total_prompt_tokens(specs: Sequence[RequestSpec]) -> int:
    """Sum of prompt lengths."""
    return sum(len(s.prompt_token_ids) for s in specs)


def total_reusable_tokens(specs: Sequence[RequestSpec]) -> int:
    """Sum of ``reusable_prefix_len``: what an ideal fleet-wide cache could serve."""
    return sum(s.reusable_prefix_len for s in specs)
