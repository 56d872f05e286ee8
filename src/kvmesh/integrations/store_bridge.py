"""Blocking calls into the async store, for engines whose loop is synchronous.

The :class:`~kvmesh.store.cache_engine.KVCacheEngine` lives on a private event loop in its own
thread. Every call waits at most its timeout: a store that is slow or unreachable turns into a
miss (lookup, retrieve) or a counted, dropped write (save), never into a stalled caller. Work
that outlives its timeout keeps running on the private loop and counts against ``max_inflight``;
once that many calls are outstanding, new calls are refused at no cost until some finish::

    engine thread ──call(timeout)──► private loop thread ──► KVCacheEngine ──► tiers
          ▲                               │
          └─────── result | miss ◄────────┘

A lookup can also be polled (:meth:`StoreBridge.begin_lookup`, :meth:`StoreBridge.poll_lookup`):
a scheduler that may ask again next step waits a short slice per step and gives up only at a
deadline, so a store that is merely slow still answers.

Saves do not block: the caller hands over a finished numpy array and gets ``False`` back when the
save was refused (too many in flight, bridge closed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvmesh.core.hashing import Namespace
from kvmesh.errors import KVMeshError
from kvmesh.store.cache_engine import KVCacheEngine, PrefixWritten, RetrieveResult, check_prompt_kv
from kvmesh.store.config import StoreConfig

_T = TypeVar("_T")
_log = logging.getLogger(__name__)


@dataclass(slots=True)
class BridgeStats:
    """Counters of a :class:`StoreBridge` (read them from any thread; they only grow)."""

    num_lookups: int = 0
    num_retrieves: int = 0
    num_saves: int = 0
    num_timeouts: int = 0
    num_refused: int = 0
    num_errors: int = 0
    num_saves_failed: int = 0
    num_pins: int = 0
    """Pins every asked tier took."""
    num_pins_refused: int = 0
    """Pins a tier refused (a tenant's budget, or a tier that cannot pin); logged with the reason."""


@dataclass(slots=True)
class PendingLookup:
    """A lookup started by :meth:`StoreBridge.begin_lookup` and not yet answered."""

    future: concurrent.futures.Future[int] | None
    """``None``: the bridge refused the call (a miss)."""
    deadline: float
    """``time.monotonic()`` past which it counts as a miss (the call itself runs on, like any
    timed-out call, and holds its ``max_inflight`` slot until it ends)."""


async def _cancel_other_tasks() -> None:
    """Cancel calls that outlived their callers (a hung tier) so the loop can stop cleanly."""
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=1.0)


class StoreBridge:
    """A :class:`KVCacheEngine` driven from synchronous code through a private event loop.

    Args:
        config: anything :meth:`KVCacheEngine.from_config` accepts.
        lookup_timeout_s: longest wait for :meth:`lookup`.
        retrieve_timeout_s: longest wait for :meth:`retrieve`.
        max_inflight: calls (saves included) allowed to be outstanding at once.
        close_timeout_s: longest wait in :meth:`close` for pending saves and tier shutdown.

    Raises:
        ConfigError: an invalid store configuration.
        ValueError: a non-positive timeout or ``max_inflight``.
    """

    def __init__(
        self,
        config: StoreConfig | str | None,
        *,
        lookup_timeout_s: float = 0.05,
        retrieve_timeout_s: float = 2.0,
        max_inflight: int = 64,
        close_timeout_s: float = 10.0,
    ) -> None:
        if min(lookup_timeout_s, retrieve_timeout_s, close_timeout_s) <= 0 or max_inflight <= 0:
            raise ValueError(
                f"timeouts and max_inflight must be positive, got lookup={lookup_timeout_s} "
                f"retrieve={retrieve_timeout_s} close={close_timeout_s} max_inflight={max_inflight}"
            )
        self.lookup_timeout_s = lookup_timeout_s
        self.retrieve_timeout_s = retrieve_timeout_s
        self.close_timeout_s = close_timeout_s
        self.max_inflight = max_inflight
        self.stats = BridgeStats()
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvmesh-store", daemon=True)
        self._thread.start()
        self._saves: set[concurrent.futures.Future[None]] = set()
        self._saves_lock = threading.Lock()
        try:
            self.engine = self._submit_unbounded(self._build(config)).result()
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _build(config: StoreConfig | str | None) -> KVCacheEngine:
        return KVCacheEngine.from_config(config)

    @property
    def chunk_size(self) -> int:
        """Tokens per store chunk."""
        return self.engine.chunk_size

    def _submit_unbounded(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T] | None:
        """Schedule ``coro`` if a slot is free; the slot is returned when it finishes."""
        if self._closed or not self._slots.acquire(blocking=False):
            coro.close()
            self.stats.num_refused += 1
            return None
        future = self._submit_unbounded(coro)
        future.add_done_callback(lambda _f: self._slots.release())
        return future

    def _wait(self, future: concurrent.futures.Future[_T], timeout_s: float) -> _T | None:
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self.stats.num_timeouts += 1
            return None
        except KVMeshError as exc:
            self.stats.num_errors += 1
            _log.warning("kvmesh store call failed: %s", exc)
            return None

    def lookup(self, tokens: Sequence[int], namespace: Namespace) -> int:
        """Prefix tokens the store holds (a multiple of the chunk size); 0 when it cannot tell in time."""
        found = self.poll_lookup(
            self.begin_lookup(tokens, namespace, self.lookup_timeout_s), self.lookup_timeout_s
        )
        return 0 if found is None else found

    def begin_lookup(self, tokens: Sequence[int], namespace: Namespace, deadline_s: float) -> PendingLookup:
        """Start a lookup that :meth:`poll_lookup` answers; a miss if unanswered after ``deadline_s``."""
        self.stats.num_lookups += 1
        future = self._submit(self.engine.lookup(list(tokens), namespace))
        return PendingLookup(future, time.monotonic() + deadline_s)

    def poll_lookup(self, pending: PendingLookup, wait_s: float) -> int | None:
        """The lookup's answer, waiting at most ``wait_s`` (never past its deadline); ``None`` while
        it is still running before its deadline, 0 for a miss (refused, failed or past the deadline)."""
        if pending.future is None:
            return 0
        try:
            return pending.future.result(max(0.0, min(wait_s, pending.deadline - time.monotonic())))
        except concurrent.futures.TimeoutError:
            if time.monotonic() < pending.deadline:
                return None
            self.stats.num_timeouts += 1
            return 0
        except KVMeshError as exc:
            self.stats.num_errors += 1
            _log.warning("kvmesh store call failed: %s", exc)
            return 0

    def retrieve(
        self,
        tokens: Sequence[int],
        namespace: Namespace,
        max_tokens: int | None = None,
        *,
        join: bool = True,
        timeout_s: float | None = None,
    ) -> RetrieveResult:
        """KV of the longest stored prefix (at most ``max_tokens``); a miss when it cannot load in
        time (``timeout_s``, default ``retrieve_timeout_s``; a longer one lets each tier read take
        as long too). ``join=False``: the chunks as they were read (``parts``), not concatenated."""
        self.stats.num_retrieves += 1
        future = self._submit(
            self.engine.retrieve(list(tokens), namespace, max_tokens, join=join, read_extra_s=timeout_s)
        )
        if future is None:
            return RetrieveResult.miss()
        result = self._wait(future, self.retrieve_timeout_s if timeout_s is None else timeout_s)
        return RetrieveResult.miss() if result is None else result

    def save(
        self,
        tokens: Sequence[int],
        namespace: Namespace,
        kv: np.ndarray,
        *,
        skip_tokens: int = 0,
        on_written: PrefixWritten | None = None,
        pin_ttl_s: float | None = None,
    ) -> bool:
        """Start saving ``kv`` (covering ``tokens[0:kv.shape[3]]``) without waiting for it.

        The array must not be modified afterwards. Returns ``False`` when the save was refused.

        Args:
            tokens: the prompt.
            namespace: its store namespace.
            kv: KV of the leading tokens, (L, 2, H, T, D).
            skip_tokens: leading tokens known to be stored already.
            on_written: told, on the bridge's loop thread, how far the prompt reaches in each
                tier whose write succeeded (:meth:`KVCacheEngine.store`).
            pin_ttl_s: then pin the saved chunks in the shared tiers for this long
                (:meth:`KVCacheEngine.pin`; written to every tier that lacks them first).

        Raises:
            ValueError: ``kv`` is not (L, 2, H, T, D) or covers more than ``tokens``.
        """
        check_prompt_kv(kv, len(tokens))
        tokens = list(tokens)
        store = self.engine.store(
            tokens,
            namespace,
            kv,
            skip_tokens=skip_tokens,
            on_written=on_written,
            every_tier=pin_ttl_s is not None,
        )
        future = self._submit(
            store if pin_ttl_s is None else self._store_and_pin(store, tokens, namespace, pin_ttl_s)
        )
        if future is None:
            return False
        self.stats.num_saves += 1
        with self._saves_lock:
            self._saves.add(future)
        future.add_done_callback(self._save_done)
        return True

    async def _store_and_pin(
        self, store: Coroutine[Any, Any, None], tokens: list[int], namespace: Namespace, ttl_s: float
    ) -> None:
        await store
        await self._pin(tokens, namespace, ttl_s)

    async def _pin(self, tokens: list[int], namespace: Namespace, ttl_s: float) -> None:
        """Pin, and count and log what the tiers did (vLLM has answered the request already)."""
        ttl_s = min(ttl_s, self.engine.pin_max_ttl_s)
        outcomes = await self.engine.pin(tokens, namespace, ttl_s)
        refused = [o for o in outcomes.values() if o is not None and not o.accepted]
        for outcome in refused:
            _log.warning("kvmesh pin refused: %s", outcome.refusal(namespace.tenant))
        if refused:
            self.stats.num_pins_refused += 1
        elif outcomes:
            self.stats.num_pins += 1

    def pin(self, tokens: Sequence[int], namespace: Namespace, ttl_s: float) -> bool:
        """Start pinning the stored chunks of ``tokens`` (already saved) without waiting for it.

        Returns ``False`` when the call was refused (too many in flight, closed).
        """
        future = self._submit(self._pin(list(tokens), namespace, ttl_s))
        if future is None:
            return False
        with self._saves_lock:
            self._saves.add(future)
        future.add_done_callback(self._save_done)
        return True

    def _save_done(self, future: concurrent.futures.Future[None]) -> None:
        with self._saves_lock:
            self._saves.discard(future)
        if future.cancelled():
            self.stats.num_saves_failed += 1
            return
        exc = future.exception()
        if exc is not None:
            self.stats.num_saves_failed += 1
            _log.error("kvmesh store save failed", exc_info=exc)

    def wait_for_saves(self, timeout_s: float) -> bool:
        """Wait until every started save has finished its RAM-tier write; ``False`` on timeout."""
        with self._saves_lock:
            pending = list(self._saves)
        if not pending:
            return True
        _done, not_done = concurrent.futures.wait(pending, timeout=timeout_s)
        return not not_done

    def drain(self, timeout_s: float) -> bool:
        """Wait for pending saves and the store's slower-tier write queues; ``False`` on timeout."""
        if not self.wait_for_saves(timeout_s):
            return False
        try:
            self._submit_unbounded(self.engine.drain()).result(timeout_s)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Finish pending saves (bounded by ``close_timeout_s``), close the tiers, stop the thread."""
        if self._closed:
            return
        self._closed = True
        self.wait_for_saves(self.close_timeout_s)
        try:
            self._submit_unbounded(self.engine.aclose()).result(self.close_timeout_s)
        except concurrent.futures.TimeoutError:
            _log.warning("kvmesh store did not close within %.1f s", self.close_timeout_s)
        try:
            self._submit_unbounded(_cancel_other_tasks()).result(self.close_timeout_s)
        except concurrent.futures.TimeoutError:
            _log.warning("kvmesh store calls still running at close")
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.close_timeout_s)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> StoreBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
