"""Scheduler-side bookkeeping of what each request loads from and saves to the store.

Per request, three token boundaries matter (all counted from the start of the prompt)::

    prompt      |----------------------------------------------------|last|
    local hit   |=========|                       vLLM's own prefix cache (num_computed)
    store hit   |=====================|           whole chunks found by lookup
    load        |         |###########|           floor to vLLM blocks, never the last token
    saved       |=====================|+++++|     whole chunks computed so far, not yet stored

A load covers ``[num_computed, load_end)``: the store's hit, cut to a multiple of the engine's
block size and to at most ``len(prompt) - 1`` tokens, because the engine must compute the last
prompt token itself to sample from it. Saves cover whole store chunks of the prompt as (chunked)
prefill computes them; each chunk is offered once per request.

The tracker is pure: it never talks to the store or to the engine. The connector feeds it the
engine's calls and ships the :class:`LoadSpec` / :class:`SaveSpec` lists it emits to the workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.core.hashing import Namespace
from kvmesh.core.shared_writes import PromptBlocks


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy stored KV of tokens ``start..end-1`` into the request's blocks.

    Attributes:
        req_id: the engine's request id.
        token_ids: the prompt up to the store chunk that holds token ``end - 1`` (the store key;
            shorter when the prompt ends first).
        block_ids: the request's blocks, in token order (at least ``ceil(end / block_size)``).
        start: first token to write (tokens before it are already computed).
        end: one past the last token to write.
        namespace: the request's store namespace.
        background: the engine waits for this load (``WAITING_FOR_REMOTE_KVS``) while it steps
            other requests; the worker runs it off the step and reports it in ``finished_recving``.
    """

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int
    namespace: Namespace
    background: bool = False


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the KV of the prompt's first ``end`` tokens; chunks ending within ``skip_tokens`` are
    already stored and are not read.

    Attributes:
        req_id: the engine's request id.
        token_ids: the prompt's first ``end`` tokens.
        block_ids: the request's blocks, in token order.
        skip_tokens: tokens known to be stored already (a multiple of the chunk size).
        end: tokens to cover, a multiple of the chunk size.
        namespace: the request's store namespace.
        blocks: the engine's names for the prompt's blocks, to announce the write when it lands
            in a shared tier (``None``: not announced).
        pin_ttl_s: pin the first ``end`` tokens' chunks for this long once saved (``None``: no
            pin). A spec with ``skip_tokens == end`` only pins (its chunks were stored before).
    """

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    skip_tokens: int
    end: int
    namespace: Namespace
    blocks: PromptBlocks | None = None
    pin_ttl_s: float | None = None


@dataclass(slots=True)
class _Request:
    prompt: tuple[int, ...]
    namespace: Namespace
    num_stored: int
    block_ids: list[int] = field(default_factory=list)
    load_start: int = 0
    load_end: int = 0
    load_pending: bool = False
    load_background: bool = False
    saved_until: int = 0
    blocks: PromptBlocks | None = None
    pin_ttl_s: float | None = None
    pinned_stored: bool = False
    """A pin-only spec was emitted for the chunks the store held at the lookup."""


def num_loadable_tokens(prompt_len: int, num_computed: int, num_stored: int, block_size: int) -> int:
    """Tokens beyond ``num_computed`` to load: the stored prefix, floored to whole blocks and kept
    short of the last prompt token; 0 when that does not reach past ``num_computed``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    end = min(num_stored, prompt_len - 1)
    end -= end % block_size
    return max(0, end - num_computed)


class RequestTracker:
    """Per-request load and save plans (one per scheduler; single-threaded).

    Args:
        chunk_size: tokens per store chunk.
        block_size: tokens per engine KV block.
        save: whether computed prompt chunks are saved (``False`` makes the connector load-only).
        background_load_min_tokens: loads of at least this many tokens run in the background
            (``None``: every load is synchronous).

    Raises:
        ValueError: a non-positive size.
    """

    def __init__(
        self,
        chunk_size: int,
        block_size: int,
        *,
        save: bool = True,
        background_load_min_tokens: int | None = None,
    ) -> None:
        if chunk_size <= 0 or block_size <= 0:
            raise ValueError(f"chunk_size and block_size must be positive, got {chunk_size}, {block_size}")
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.save = save
        self.background_load_min_tokens = background_load_min_tokens
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._requests

    def num_stored(self, req_id: str) -> int | None:
        """The store hit recorded by :meth:`on_lookup` (``None`` when none was recorded)."""
        req = self._requests.get(req_id)
        return None if req is None else req.num_stored

    def on_lookup(
        self,
        req_id: str,
        prompt: Sequence[int],
        namespace: Namespace,
        num_computed: int,
        num_stored: int,
        blocks: PromptBlocks | None = None,
        pin_ttl_s: float | None = None,
    ) -> int:
        """Record a lookup's outcome and plan the load.

        Args:
            req_id: the request.
            prompt: its prompt tokens.
            namespace: its store namespace.
            num_computed: tokens the engine already has (its own prefix cache, block-aligned).
            num_stored: the store's hit (a multiple of the chunk size).
            blocks: the engine's names for the prompt's blocks, passed on with its saves (kept
                from an earlier lookup when ``None``).
            pin_ttl_s: pin the prompt's chunks for this long as they are saved (kept from an
                earlier lookup when ``None``).

        Returns:
            Tokens to load beyond ``num_computed`` (the engine allocates blocks for them).
        """
        req = self._requests.get(req_id)
        if req is None:
            req = _Request(tuple(prompt), namespace, num_stored)
            req.saved_until = num_stored - num_stored % self.chunk_size
            self._requests[req_id] = req
        else:
            req.num_stored = num_stored
            req.saved_until = max(req.saved_until, num_stored - num_stored % self.chunk_size)
        if blocks is not None:
            req.blocks = blocks
        if pin_ttl_s is not None:
            req.pin_ttl_s = pin_ttl_s
        num_load = num_loadable_tokens(len(req.prompt), num_computed, num_stored, self.block_size)
        req.load_start = num_computed
        req.load_end = num_computed + num_load
        req.load_pending = False
        threshold = self.background_load_min_tokens
        req.load_background = threshold is not None and num_load > 0 and num_load >= threshold
        return num_load

    def loads_in_background(self, req_id: str) -> bool:
        """Whether the load :meth:`on_lookup` planned for ``req_id`` runs in the background."""
        req = self._requests.get(req_id)
        return req is not None and req.load_background

    def on_alloc(self, req_id: str, num_external_tokens: int, block_ids: Sequence[int] | None = None) -> None:
        """The engine allocated blocks for ``num_external_tokens`` loaded tokens (0: load nothing).

        A background load is emitted at once, on ``block_ids`` (the request's blocks): the engine
        does not schedule the request until the load is reported done. A synchronous one is emitted
        when the request is scheduled.

        Raises:
            ValueError: more tokens than the lookup offered, or a background load without blocks.
        """
        req = self._requests.get(req_id)
        if req is None:
            if num_external_tokens:
                raise ValueError(f"request {req_id!r} has no lookup but {num_external_tokens} tokens to load")
            return
        offered = req.load_end - req.load_start
        if num_external_tokens > offered:
            raise ValueError(
                f"request {req_id!r}: {num_external_tokens} tokens allocated for loading, {offered} offered"
            )
        req.load_end = req.load_start + num_external_tokens
        req.load_pending = num_external_tokens > 0
        if req.load_pending and req.load_background:
            if block_ids is None:
                raise ValueError(f"request {req_id!r}: a background load needs the request's blocks")
            req.block_ids = list(block_ids)
            req.load_pending = False
            self._loads.append(self._load_spec(req_id, req, background=True))

    def on_scheduled(
        self,
        req_id: str,
        *,
        prompt: Sequence[int] | None,
        namespace: Namespace | None,
        block_ids: Sequence[int] | None,
        replace_blocks: bool,
        num_computed: int,
        num_scheduled: int,
    ) -> None:
        """The engine scheduled ``num_scheduled`` tokens after ``num_computed`` this step.

        Args:
            req_id: the request.
            prompt: its prompt (needed only when no lookup was recorded).
            namespace: its store namespace (likewise).
            block_ids: the request's blocks (``replace_blocks``) or blocks appended this step.
            replace_blocks: ``block_ids`` is the full list (a new or resumed request).
            num_computed: tokens computed before this step, loaded ones included.
            num_scheduled: tokens computed by this step.
        """
        req = self._requests.get(req_id)
        if req is None:
            if prompt is None or namespace is None:
                return
            req = _Request(tuple(prompt), namespace, 0)
            self._requests[req_id] = req
        if replace_blocks:
            req.block_ids = list(block_ids or ())
        elif block_ids:
            req.block_ids.extend(block_ids)
        if req.load_pending:
            req.load_pending = False
            self._loads.append(self._load_spec(req_id, req, background=False))
        if not self.save:
            return
        if req.pin_ttl_s is not None and not req.pinned_stored and req.saved_until > 0:
            # The chunks stored before this request are pinned now; later saves pin their own.
            req.pinned_stored = True
            stored = req.saved_until
            self._saves.append(
                SaveSpec(
                    req_id,
                    req.prompt[:stored],
                    tuple(req.block_ids),
                    stored,
                    stored,
                    req.namespace,
                    None,
                    req.pin_ttl_s,
                )
            )
        done = min(num_computed + num_scheduled, len(req.prompt))
        end = done - done % self.chunk_size
        if end > req.saved_until:
            self._saves.append(
                SaveSpec(
                    req_id,
                    req.prompt[:end],
                    tuple(req.block_ids),
                    req.saved_until,
                    end,
                    req.namespace,
                    req.blocks,
                    req.pin_ttl_s,
                )
            )
            req.saved_until = end

    def on_background_loads_done(
        self, req_ids: Sequence[str] | set[str], invalid_block_ids: set[int]
    ) -> None:
        """The workers finished these background loads; a request any of whose blocks failed is
        offered nothing from the store again (vLLM asks anew when a load left no valid token, and
        the same chunks would fail the same way)."""
        if not invalid_block_ids:
            return
        for req_id in req_ids:
            req = self._requests.get(req_id)
            if req is not None and not invalid_block_ids.isdisjoint(req.block_ids):
                req.num_stored = 0

    def _load_spec(self, req_id: str, req: _Request, *, background: bool) -> LoadSpec:
        chunks = -(-req.load_end // self.chunk_size)
        return LoadSpec(
            req_id,
            req.prompt[: chunks * self.chunk_size],
            tuple(req.block_ids),
            req.load_start,
            req.load_end,
            req.namespace,
            background,
        )

    def take_specs(self) -> tuple[list[LoadSpec], list[SaveSpec]]:
        """The loads and saves emitted since the last call (the next step's work)."""
        loads, saves = self._loads, self._saves
        self._loads, self._saves = [], []
        return loads, saves

    def finish(self, req_id: str) -> None:
        """Forget a finished or aborted request."""
        self._requests.pop(req_id, None)
