"""A request inside the engine: its tokens for the runner, its outputs for the server, its figures."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.core.tenancy import Role
from kvmesh.engine.pins import PinResult
from kvmesh.engine.runner import KVArray, SamplingParams, Sequence
from kvmesh.engine.step_scheduler import ScheduledRequest
from kvmesh.engine.store_connector import LoadedPrefix

if TYPE_CHECKING:
    from kvmesh.store.keys import StoreKey


@dataclass(slots=True)
class RequestOutput:
    """A delta of one request's output, as the server streams it."""

    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    """"stop" (EOS or a stop token), "length", "abort" or "error"."""


@dataclass(slots=True)
class EngineStats:
    """Running totals the metrics endpoint exports."""

    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    """Prompt tokens found in the device-tier cache."""
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    """Prompt tokens served from a cache, per tier (GPU = device tier; others from the store)."""
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_store_writes: int = 0
    num_store_write_failures: int = 0
    num_store_read_failures: int = 0
    num_store_loads: int = 0
    """Prefixes loaded from the store (each timed below)."""
    store_fetch_seconds: float = 0.0
    """Time spent finding and reading loaded prefixes (lookup, tier reads, checksums)."""
    store_to_runner_seconds: float = 0.0
    """Time spent moving loaded prefixes into the runner's memory at admission."""
    num_kv_export_failures: int = 0
    """Computed KV that could not be copied out of the runner (not cached; the request went on)."""
    num_steps: int = 0


class EngineRequest(ScheduledRequest):
    """One request inside the engine; iterate it for :class:`RequestOutput` deltas."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        tenant: str = "",
        role: Role = Role.BOTH,
        arrival_time: float | None = None,
    ) -> None:
        super().__init__(
            request_id=request_id,
            prompt_len=len(prompt_token_ids),
            max_output=1 if role is Role.PREFILL else sampling.max_tokens,
        )
        self.seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), sampling)
        self.tenant = tenant
        self.role = role
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.loaded: LoadedPrefix | None = None
        self.store_keys: list[StoreKey] | None = None
        """Store keys of the prompt's full chunks, hashed once (the first time the store is asked)
        and used for its read, its write and the local tiers' announcements."""
        self.prefix_kv: KVArray | None = None
        """KV of the cached prefix for the first chunk when it came from the store."""
        self.num_cached_tokens = 0
        self.cached_tier: str | None = None
        self.num_reported_cached_tokens: int | None = None
        """Prompt tokens found cached at the first admission: what ``usage`` reports, as vLLM does.
        A preempted request re-admitted later finds its own blocks cached; that is not a hit."""
        self.reported_cached_by_tier: dict[str, int] = {}
        """``num_reported_cached_tokens`` per tier that served them (``Medium`` values)."""
        self.store_fault = False
        """A store read for this prompt failed or came back short of what the store said it held
        (the request recomputed that part)."""
        self.num_output_tokens = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.token_gaps: list[float] = []
        """Seconds between consecutive output tokens (the inter-token latencies metrics export)."""
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.aborted = False
        self.store_done: asyncio.Future[None] | None = None
        """Set while the prompt's KV is being written to the store; done when the write finished."""
        self.store_queued = False
        self.pin_ttl_s: float | None = None
        """Pin the prompt's chunks in the store's shared tiers for this long once written."""
        self.pin_results: list[PinResult] | None = None
        """What the store's tiers did with the pin (``None``: not pinned yet, or not asked)."""
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output_token_ids(self) -> list[int]:
        return self.seq.token_ids[self.seq.num_prompt_tokens :]

    async def next_output(self, timeout: float | None = None) -> RequestOutput | None:
        """The next delta; ``None`` if ``timeout`` passes first."""
        if timeout is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    def drain_outputs(self) -> list[RequestOutput]:
        """Deltas already queued, without waiting."""
        items = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            out = await self._queue.get()
            yield out
            if out.finished:
                return

    def _emit(self, out: RequestOutput) -> None:
        self._queue.put_nowait(out)
