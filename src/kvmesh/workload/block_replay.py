"""What every workload built on hash-id blocks shares: its block source and its token stream.

Such a workload yields its requests as blocks (:meth:`block_requests`, a prompt a tuple of hash ids)
and draws the tokens of each block from :class:`BlockTokens`; its token stream is the block stream
with every prompt's tokens filled in.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from kvmesh.workload.spec import RequestSpec
from kvmesh.workload.trace_blocks import BlockTokens


class BlockWorkload(Protocol):
    """The settings of a workload whose prompts are chains of hash-id blocks."""

    @property
    def block_tokens(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def token_low(self) -> int: ...
    @property
    def cached_blocks(self) -> int: ...


def block_source(workload: BlockWorkload) -> BlockTokens:
    """A fresh token source for one pass over ``workload``'s blocks."""
    return BlockTokens(
        workload.block_tokens,
        seed=workload.seed,
        vocab_size=workload.vocab_size,
        token_low=workload.token_low,
        capacity_blocks=workload.cached_blocks,
    )


def with_token_ids(block_requests: Iterator[RequestSpec]) -> Iterator[RequestSpec]:
    """``block_requests`` with each prompt's tokens filled in from its blocks."""
    for spec in block_requests:
        assert spec.prompt_blocks is not None, "block_requests carries every prompt as blocks"
        spec.prompt_token_ids = spec.prompt_blocks.token_ids()
        yield spec
