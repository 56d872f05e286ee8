"""The engine's scheduling policy, pure and synchronous: one object for the engine and the simulator.

vLLM v1's loop, without a clock or a model::

    out = scheduler.schedule()        # which prompt chunks and how many decode tokens run next
    ...run the step (a model, the emulated GPU, or virtual time)...
    done = scheduler.update(out)      # advance progress; requests that hit their length finish

Per step, within ``max_num_batched_tokens``:

1. every decoding request takes one token (decodes are never starved);
2. requests mid-prefill take their next chunk (chunked prefill, in admission order);
3. waiting requests are admitted FCFS while budget, ``max_num_seqs`` and KV allow. Admission pins
   the cached prefix (never the block holding the last prompt token, which must be computed for
   logits), lets the driver pull more of it from lower tiers (:meth:`SchedulerHooks.on_admit`), and
   reserves the remaining full prompt blocks. A request that cannot fit an empty engine is rejected.

KV accounting: full prompt blocks belong to the request's :class:`Allocation`; tokens of partial
blocks and generated tokens ("private" tokens) live in one engine-wide reservation sized
``ceil(private / block_size) + running`` blocks, so prompt blocks, decode tokens and evictable cached
blocks share one capacity as in vLLM. When decode tokens no longer fit, the newest request is
preempted (recompute mode: it keeps its output and recomputes its KV when readmitted); nothing is
admitted in the step right after a preemption.

Decoding requests advance by an engine-wide step counter (``generated = steps - base``), so a run of
``k`` decode-only steps (:meth:`StepScheduler.schedule` with ``max_steps`` > 1, which the simulator
uses) costs O(1) however large the batch.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, Protocol, TypeVar

from kvmesh.core.types import BlockKey
from kvmesh.engine.prefix_cache import Allocation, PrefixCache


@dataclass(slots=True, eq=False, kw_only=True)
class ScheduledRequest:
    """What the scheduler knows of a request; the engine's and the simulator's requests extend it."""

    request_id: str
    keys: list[BlockKey] = field(default_factory=list)
    """Device-tier block keys of the prompt's full blocks."""
    prompt_len: int = 0
    max_output: int = 1
    """Tokens it generates at most; reaching it finishes the request."""
    # progress, owned by the scheduler
    target: int = 0
    """Tokens to compute before the next token is sampled (the prompt, plus the output on a resume)."""
    computed: int = 0
    generated: int = 0
    """Output tokens, exact while not decoding (decoding: ``steps - base``)."""
    base: int = 0
    decoding: bool = False
    version: int = 0
    alloc: Allocation | None = None
    private: int = 0
    """Tokens of this request counted in the engine-wide reservation (prompt tail + recompute)."""
    num_preemptions: int = 0
    order: int = 0


R = TypeVar("R", bound=ScheduledRequest)
R_contra = TypeVar("R_contra", bound=ScheduledRequest, contravariant=True)


class Release(Enum):
    """Why a request gives its KV back."""

    FINISHED = "finished"
    ABORTED = "aborted"
    PREEMPTED = "preempted"
    """Preempted while prefilling: nothing was generated yet, the prefill starts over."""
    PREEMPTED_DECODING = "preempted_decoding"
    """Preempted while decoding: its output so far stays, the prompt and it are recomputed."""

    @property
    def preempted(self) -> bool:
        return self is Release.PREEMPTED or self is Release.PREEMPTED_DECODING


class SchedulerHooks(Protocol[R_contra]):
    """What the driver does at the scheduler's turning points (the cache and KV stay its business)."""

    def on_admit(self, req: R_contra, gpu_tokens: int) -> int:
        """``req`` was admitted with ``gpu_tokens`` of its prompt cached on the device; returns the
        further prompt tokens the driver loaded from lower tiers (cached onto ``req.alloc``)."""
        ...

    def on_computed(self, req: R_contra) -> None:
        """``req.computed`` prompt tokens are computed: cache the newly full blocks."""
        ...

    def on_prefill_done(self, req: R_contra) -> None:
        """``req``'s prefill finished; its next token is out."""
        ...

    def on_release(self, req: R_contra, why: Release) -> None:
        """``req`` is about to give back its blocks (still held during the call)."""
        ...


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """vLLM's batching knobs."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")


@dataclass(slots=True)
class SchedulerOutput(Generic[R]):
    """One planned step (or ``num_steps`` identical decode-only steps)."""

    prefills: list[tuple[R, int, int]] = field(default_factory=list)
    """(request, first token, end token) of each prompt chunk."""
    num_decodes: int = 0
    num_steps: int = 0
    """0: nothing to run."""
    decode_context_tokens: int = 0
    """Sum of the decoding requests' context lengths at the first step (for the cost model)."""
    rejected: list[R] = field(default_factory=list)
    """Requests that cannot fit even an idle engine; dropped from the queue."""

    @property
    def empty(self) -> bool:
        return self.num_steps == 0


class StepScheduler(Generic[R]):
    """Continuous batching over a :class:`PrefixCache`.

    Args:
        cache: the device-tier prefix cache whose capacity bounds the batch.
        limits: batching knobs.
        hooks: the driver's side (loads from lower tiers, block caching, release of runner state).
        name: owner name of the engine-wide reservation in the cache.
    """

    def __init__(
        self, cache: PrefixCache, limits: BatchLimits, hooks: SchedulerHooks[R], name: str = "engine"
    ) -> None:
        self.cache = cache
        self.limits = limits
        self.hooks = hooks
        self.block_size = cache.block_size
        self.waiting: deque[R] = deque()
        self.running: list[R] = []
        """Admitted and not finished, in admission order (the newest is preempted first)."""
        self.prefilling: list[R] = []
        self.num_decoding = 0
        self.steps = 0
        """Steps run so far: a decoding request's output length is ``steps - base``."""
        self._finish_heap: list[tuple[int, int, int, R]] = []
        self._order = 0
        self._sum_base = 0
        self._sum_prompt_decoding = 0
        self._private_fixed = 0
        reserve = cache.allocate(f"{name}/decode", [], 0, 0)
        assert reserve is not None, "an empty reservation always fits"
        self._reserve: Allocation = reserve
        self._reserved_blocks = 0
        self._preempted = False
        self._room_checked = False

    # ------------------------------------------------------------------ queue

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, req: R) -> None:
        """Queue ``req`` (FCFS)."""
        req.order = self._order
        self._order += 1
        self.waiting.append(req)

    def decoding_requests(self) -> list[R]:
        """Running requests past their prefill, in admission order (O(running))."""
        return [r for r in self.running if r.decoding]

    def can_admit_now(self) -> bool:
        """Whether a new arrival could join the next step (a free sequence slot)."""
        return len(self.running) < self.limits.max_num_seqs

    # ------------------------------------------------------------------ KV accounting

    def _private_tokens(self) -> int:
        return self._private_fixed + self.num_decoding * self.steps - self._sum_base

    def _private_blocks(self) -> int:
        return -(-self._private_tokens() // self.block_size) + len(self.running)

    def _sync_reservation(self) -> bool:
        """Make the engine-wide reservation match the private tokens; ``False`` if it cannot grow."""
        want = self._private_blocks()
        have = self._reserved_blocks
        if want > have:
            if not self.cache.grow(self._reserve, want - have):
                return False
        elif want < have:
            self.cache.shrink(self._reserve, have - want)
        self._reserved_blocks = want
        return True

    def decode_run_length(self, max_steps: int) -> int:
        """Decode steps until the next length finish, the KV-full point, or ``max_steps``."""
        d = self.num_decoding
        heap = self._finish_heap
        while heap and heap[0][2] != heap[0][3].version:
            heapq.heappop(heap)
        k = max_steps
        if heap:
            k = min(k, max(1, heap[0][0] - self.steps))
        cache = self.cache
        # Each step adds d tokens; full blocks are reserved as tokens cross block boundaries.
        free_blocks = (
            cache.capacity_blocks - cache.num_used_blocks + self._reserved_blocks - len(self.running)
        )
        free_tokens = free_blocks * self.block_size - self._private_tokens()
        return max(0, min(k, free_tokens // d)) if d else 0

    # ------------------------------------------------------------------ schedule

    def schedule(self, max_steps: int = 1) -> SchedulerOutput[R]:
        """Plan the next step; a decode-only step may stand for up to ``max_steps`` identical ones."""
        if not self._room_checked:
            self.make_room()
        out: SchedulerOutput[R] = SchedulerOutput()
        limits = self.limits
        budget = limits.max_num_batched_tokens - self.num_decoding
        prefills = out.prefills
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.target - req.computed, budget)
            prefills.append((req, req.computed, req.computed + n))
            budget -= n
        admit = not self._preempted
        self._preempted = False
        waiting = self.waiting
        while admit and budget > 0 and waiting and len(self.running) < limits.max_num_seqs:
            req = waiting[0]
            if not self._admit(req):
                if not self.running:
                    waiting.popleft()
                    out.rejected.append(req)
                    continue
                break
            waiting.popleft()
            n = min(req.target - req.computed, budget)
            prefills.append((req, req.computed, req.computed + n))
            budget -= n
        d = self.num_decoding
        if not prefills and d == 0:
            return out
        out.num_decodes = d
        out.decode_context_tokens = self._sum_prompt_decoding + self._private_generated() + d
        if prefills:
            out.num_steps = 1
            return out
        if not admit and waiting:
            max_steps = 1  # admission was held back for this step only; try again after it
        n_steps = self.decode_run_length(max_steps)
        if n_steps == 0:
            self._preempt_newest()
            rest = self.schedule(max_steps)
            rest.rejected[:0] = out.rejected
            return rest
        out.num_steps = n_steps
        return out

    def _private_generated(self) -> int:
        return self.num_decoding * self.steps - self._sum_base

    def make_room(self) -> None:
        """Preempt the newest requests until the next step's decode tokens fit (``schedule`` does it
        first; a driver may call it earlier to see the KV state the next step starts from)."""
        while self.running and not self._sync_reservation():
            self._preempt_newest()
        while self.num_decoding and self.decode_run_length(1) == 0 and len(self.running) > 1:
            self._preempt_newest()
        if not self.running:
            self._sync_reservation()
        self._room_checked = True

    def _admit(self, req: R) -> bool:
        """Pin the cached prefix, let the driver load more, reserve the rest; ``False`` if KV is short."""
        bs = self.block_size
        cache = self.cache
        keys = req.keys
        resumed = req.generated > 0
        hit = min(cache.match(keys), (req.prompt_len - 1) // bs)
        tail = req.prompt_len - len(keys) * bs + (req.generated if resumed else 0)
        alloc = cache.allocate(req.request_id, keys, hit, len(keys) - hit)
        if alloc is None:
            return False
        want = -(-(self._private_tokens() + tail) // bs) + len(self.running) + 1
        if want > self._reserved_blocks and not cache.grow(self._reserve, want - self._reserved_blocks):
            cache.free(alloc)
            return False
        self._reserved_blocks = max(want, self._reserved_blocks)
        req.alloc = alloc
        req.private = tail
        self._private_fixed += tail
        self.running.append(req)
        self.prefilling.append(req)
        req.target = req.prompt_len + (req.generated if resumed else 0)
        gpu_tokens = hit * bs
        req.computed = gpu_tokens
        loaded = self.hooks.on_admit(req, gpu_tokens)
        if loaded:
            req.computed += loaded
            self.hooks.on_computed(req)
        if self._reserved_blocks != want:  # want counts this request: only a shrink can be due
            self._sync_reservation()
        return True

    # ------------------------------------------------------------------ update

    def update(self, out: SchedulerOutput[R], num_steps: int | None = None) -> list[R]:
        """Apply a finished step (``num_steps`` of a decode run when it was cut short).

        Returns:
            Requests that reached ``max_output`` and finished, in order.
        """
        self.steps += out.num_steps if num_steps is None else num_steps
        self._room_checked = False
        finished: list[R] = []
        for req, _start, end in out.prefills:
            if req.alloc is None or req.decoding:
                continue  # aborted or preempted since it was planned
            req.computed = end
            self.hooks.on_computed(req)
            if end >= req.target:
                self._prefill_done(req, finished)
        heap = self._finish_heap
        while heap and heap[0][0] <= self.steps:
            _, _, version, req = heapq.heappop(heap)
            if version == req.version:
                self._stop_decoding(req)
                self._release(req, Release.FINISHED)
                finished.append(req)
        if finished:
            self._sync_reservation()  # hand the finished requests' tokens back now
        return finished

    def _prefill_done(self, req: R, finished: list[R]) -> None:
        self.prefilling.remove(req)
        self.hooks.on_prefill_done(req)
        g = req.generated + 1
        self._private_fixed -= req.private
        req.private = req.prompt_len - len(req.keys) * self.block_size
        self._private_fixed += req.private
        if g >= req.max_output:
            req.generated = req.max_output
            self._release(req, Release.FINISHED)
            finished.append(req)
            return
        req.decoding = True
        req.base = self.steps - g
        self.num_decoding += 1
        self._sum_base += req.base
        self._sum_prompt_decoding += req.prompt_len
        heapq.heappush(self._finish_heap, (req.base + req.max_output, req.order, req.version, req))

    def generated(self, req: R) -> int:
        """Output tokens of ``req`` so far."""
        return self.steps - req.base if req.decoding else req.generated

    # ------------------------------------------------------------------ endings

    def finish(self, req: R) -> None:
        """End ``req`` before its length (a stop token, the model's length); no-op if not running."""
        if req.alloc is not None:
            self._end_running(req, Release.FINISHED)

    def abort(self, req: R) -> bool:
        """Drop ``req`` wherever it is; ``False`` if the scheduler does not hold it."""
        if req.alloc is None:
            if req in self.waiting:
                self.waiting.remove(req)
                return True
            return False
        self._end_running(req, Release.ABORTED)
        return True

    def _end_running(self, req: R, how: Release) -> None:
        """Take a running ``req`` out of its phase and give its blocks back."""
        if req.decoding:
            self._stop_decoding(req)
        else:
            self.prefilling.remove(req)
        self._release(req, how)
        self._sync_reservation()

    def _stop_decoding(self, req: R) -> None:
        req.generated = self.steps - req.base
        req.decoding = False
        self.num_decoding -= 1
        self._sum_base -= req.base
        self._sum_prompt_decoding -= req.prompt_len
        req.version += 1

    def _release(self, req: R, why: Release) -> None:
        self.hooks.on_release(req, why)
        self.running.remove(req)
        self._private_fixed -= req.private
        req.private = 0
        alloc = req.alloc
        if alloc is not None:
            self.cache.free(alloc)
            req.alloc = None

    def _preempt_newest(self) -> None:
        req = self.running[-1]
        if req.decoding:
            self._stop_decoding(req)
            why = Release.PREEMPTED_DECODING
        else:
            self.prefilling.remove(req)
            why = Release.PREEMPTED
        self._release(req, why)
        self._preempted = True
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self._sync_reservation()
