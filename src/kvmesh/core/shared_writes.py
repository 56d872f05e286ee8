"""SHARED announcements: a prompt's blocks reached a shared store tier, so every replica can load them.

When a write lands in a shared tier (Redis/Valkey, a shared directory), the writer publishes one
``BlockStored`` with ``medium="SHARED"`` for the prompt's blocks from the root through the run of
chunks that tier holds (the store checks the chunks the write skipped). The event names the blocks
exactly as the writer's own events do (its block hashes, block size, LoRA and extra keys), so a
router keeps one identity per block.

This is the one announcer of the project; kvmesh's engine and the vLLM connector both use it::

    engine      store write ─► on_written(medium, end) ─┐
    vLLM        scheduler lookup ─► PromptBlocks ─► SaveSpec.blocks ─► worker's store write ─► on_written(tier, end)
                                                        └─► SharedWriteAnnouncer ─► BlockStored(SHARED)
                                                            └─► take_events() ─► the writer's publisher

``extra_keys`` follow vLLM's event convention: per block, the LoRA name on every block, then the
cache salt (kvmesh's tenant) on the first one; the router reads the tenant from block 0's keys.
The writer supplies the event class (vLLM's own ``BlockStored`` under vLLM, else
:class:`kvmesh.core.events.BlockStored`) and moves the events.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from kvmesh.core.types import ExternalBlockHash, Medium

PrefixWritten: TypeAlias = Callable[[str, int], None]
"""A store's report that tier ``tier`` (its name, or a :class:`Medium`) holds a prompt's first ``end`` tokens."""


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """How the writing engine (kvmesh's or vLLM) names a prompt's full blocks in its KV events.

    Attributes:
        block_hashes: the engine's external hashes of the prompt's first blocks, in chain order.
        block_size: tokens per engine block.
        lora_id: the LoRA adapter id (vLLM's deprecated ``lora_id`` field).
        lora_name: the LoRA name; it is also every block's first extra key.
        cache_salt: the request's salt; the first block's last extra key.
        group_idx: the KV cache group the engine's events carry (``None``: untagged).
        kv_cache_spec_kind: the group's cache kind, as the engine's events carry it.
        kv_cache_spec_sliding_window: the group's window, as the engine's events carry it.
        session_id: the session of the request that wrote the blocks.
    """

    block_hashes: tuple[ExternalBlockHash, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    session_id: str | None = None

    def extra_keys(self, num_blocks: int) -> list[tuple[str, ...] | None]:
        """Per block, the untagged extra keys vLLM's events carry: the LoRA name on every block,
        then the cache salt on the first one (``None`` for a block with neither)."""
        lora = (self.lora_name,) if self.lora_name else ()
        first = lora + ((self.cache_salt,) if self.cache_salt else ())
        return [(first if i == 0 else lora) or None for i in range(num_blocks)]


def shared_stored_event(
    blocks: PromptBlocks, token_ids: Sequence[int], end: int, event_type: type[Any]
) -> Any:
    """A root-anchored ``BlockStored`` with medium ``"SHARED"`` for the blocks of ``token_ids[0:end]``.

    Args:
        blocks: the engine's names for the prompt's blocks.
        token_ids: the prompt (at least ``end`` tokens, or as many as ``blocks`` names).
        end: tokens the shared tier now holds from the prompt's start.
        event_type: the ``BlockStored`` class to build (vLLM's, or :class:`kvmesh.core.events.BlockStored`).

    Returns:
        The event, or ``None`` when ``end`` covers no whole block that ``blocks`` names.
    """
    num_blocks = _num_blocks(blocks, token_ids, end)
    if num_blocks <= 0:
        return None
    optional = {
        "group_idx": blocks.group_idx,
        "kv_cache_spec_kind": blocks.kv_cache_spec_kind,
        "kv_cache_spec_sliding_window": blocks.kv_cache_spec_sliding_window,
        "session_id": blocks.session_id,
    }
    return event_type(
        block_hashes=list(blocks.block_hashes[:num_blocks]),
        parent_block_hash=None,
        token_ids=list(token_ids[: num_blocks * blocks.block_size]),
        block_size=blocks.block_size,
        lora_id=blocks.lora_id,
        medium=Medium.SHARED.value,
        lora_name=blocks.lora_name,
        extra_keys=blocks.extra_keys(num_blocks),
        # Unset fields stay out, so event classes of vLLM versions without them still build.
        **{name: value for name, value in optional.items() if value is not None},
    )


def _num_blocks(blocks: PromptBlocks, token_ids: Sequence[int], end: int) -> int:
    """Whole blocks of ``token_ids[0:end]`` that ``blocks`` names."""
    return min(end // blocks.block_size, len(blocks.block_hashes), len(token_ids) // blocks.block_size)


class SharedWriteAnnouncer:
    """Turns one worker's store-write reports into SHARED events.

    Reports may arrive on the store's loop thread while :meth:`take_events` runs on the engine's,
    hence the lock.

    Args:
        event_type: the ``BlockStored`` class to build.
        wake: called after each new event (the writer may be idle and must publish it).
    """

    def __init__(self, event_type: type[Any], wake: Callable[[], None] | None = None) -> None:
        self.event_type = event_type
        self._wake = wake
        self._lock = threading.Lock()
        self._events: list[Any] = []

    def on_written(self, blocks: PromptBlocks, token_ids: Sequence[int]) -> PrefixWritten:
        """The ``on_written`` callback of one save of ``token_ids``: an event whenever a shared
        tier holds more of the prompt than announced for this save (a second shared tier that
        holds as much adds nothing; local tiers and dropped writes add nothing)."""
        announced = 0  # blocks

        def report(tier: str, end: int) -> None:
            nonlocal announced
            if Medium.parse(tier) is not Medium.SHARED or _num_blocks(blocks, token_ids, end) <= announced:
                return
            event = shared_stored_event(blocks, token_ids, end, self.event_type)
            announced = len(event.block_hashes)
            with self._lock:
                self._events.append(event)
            if self._wake is not None:
                self._wake()

        return report

    def take_events(self) -> list[Any]:
        """Events since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events
