"""Saves run off vLLM's step: one thread copies each save's KV out of the paged cache and hands it
to the store, and the worker learns which finished requests' blocks may be freed.

vLLM frees a finished request's blocks only once the worker reports it in ``finished_sending``
(when the scheduler's ``request_finished`` returned ``True``), so a copy still reading the blocks
never races a new owner writing them. A save that fails still counts as done: its blocks are
released and the chunks are a later miss.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from kvmesh.integrations.request_tracker import SaveSpec
from kvmesh.integrations.serial_thread import SerialThread

__all__ = ["BackgroundSaver"]

_log = logging.getLogger(__name__)


class BackgroundSaver:
    """Runs ``run(spec, after)`` for each submitted save on one thread, in submission order.

    Args:
        run: copies one save out of the cache and starts storing it; ``after`` is what the save was
            submitted with (a device fence, or ``None``); any exception is logged and the save
            counts as done.
    """

    def __init__(self, run: Callable[[SaveSpec, Any], object]) -> None:
        self._run = run
        self._changed = threading.Condition()
        self._pending: dict[str, int] = {}
        self._tracked: set[str] = set()
        self._awaiting: set[str] = set()
        self.num_failed = 0
        self._worker: SerialThread[tuple[SaveSpec, Any]] = SerialThread(self._save, "kvmesh-saver")

    def submit(self, spec: SaveSpec, after: Any = None) -> None:
        """Queue ``spec``; its request's blocks stay held until the save has run.

        Args:
            spec: the save.
            after: handed to ``run`` with it: the point in the engine's work the KV was complete.
        """
        with self._changed:
            self._pending[spec.req_id] = self._pending.get(spec.req_id, 0) + 1
            self._tracked.add(spec.req_id)
        self._worker.put((spec, after))

    def wait_for(self, req_ids: Iterable[str], timeout_s: float | None = None) -> bool:
        """Block until no save of ``req_ids`` is queued or running; ``False`` on timeout."""
        wanted = set(req_ids)
        with self._changed:
            return self._changed.wait_for(lambda: not wanted & self._pending.keys(), timeout_s)

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests whose blocks may be freed now.

        ``finished_req_ids`` are the requests vLLM finished since the last call; of those and the
        ones still waiting, each that had saves is returned once, after its last save ran.
        """
        with self._changed:
            self._awaiting |= self._tracked & set(finished_req_ids)
            done = {req_id for req_id in self._awaiting if req_id not in self._pending}
            self._awaiting -= done
            self._tracked -= done
            return done

    def close(self, timeout_s: float) -> None:
        """Run the queued saves, then stop the thread (waits at most ``timeout_s``)."""
        self._worker.close(timeout_s)

    def _save(self, item: tuple[SaveSpec, Any]) -> None:
        spec, after = item
        try:
            self._run(spec, after)
        except Exception:
            self.num_failed += 1
            _log.exception("kvmesh save of request %s failed; its blocks are released", spec.req_id)
        finally:
            with self._changed:
                left = self._pending[spec.req_id] - 1
                if left:
                    self._pending[spec.req_id] = left
                else:
                    del self._pending[spec.req_id]
                self._changed.notify_all()
