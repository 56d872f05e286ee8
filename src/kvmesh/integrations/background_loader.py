"""Large loads run off vLLM's step: one thread reads each load's chunks from the store into the
request's blocks while vLLM keeps stepping the other requests.

vLLM holds such a request in ``WAITING_FOR_REMOTE_KVS`` with its blocks allocated and not yet
cached, and schedules it once the worker reports it in ``finished_recving``; an aborted request's
blocks stay allocated until then too, so a load never writes blocks that have a new owner. Blocks a
load could not fill are reported with the request (``get_block_ids_with_load_errors`` is read in the
same step, after ``get_finished``), and vLLM recomputes them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvmesh.integrations.request_tracker import LoadSpec
from kvmesh.integrations.serial_thread import SerialThread

__all__ = ["BackgroundLoader"]

_log = logging.getLogger("vllm.kvmesh.loader")  # shows in the vLLM server's log, as the connector's lines do


class BackgroundLoader:
    """Runs ``run(spec)`` for each submitted load on one thread, in submission order.

    Args:
        run: fills one load's blocks and returns the block ids it could not fill.
        blocks_of: the block ids a load writes; all of them fail when ``run`` raises.
    """

    def __init__(
        self, run: Callable[[LoadSpec], set[int]], blocks_of: Callable[[LoadSpec], set[int]]
    ) -> None:
        self._run = run
        self._blocks_of = blocks_of
        self._lock = threading.Lock()
        self._done: dict[str, set[int]] = {}
        self._in_flight: set[str] = set()
        self.num_failed = 0
        self._worker = SerialThread(self._load, "kvmesh-loader")

    def submit(self, spec: LoadSpec) -> None:
        """Queue ``spec``; :meth:`take_finished` reports it once it ran."""
        with self._lock:
            self._in_flight.add(spec.req_id)
        self._worker.put(spec)

    def take_finished(self) -> dict[str, set[int]]:
        """Loads that ran since the last call: request id → blocks not filled (empty when whole)."""
        with self._lock:
            done, self._done = self._done, {}
            return done

    def num_in_flight(self) -> int:
        """Loads queued or running."""
        with self._lock:
            return len(self._in_flight)

    def close(self, timeout_s: float) -> None:
        """Run the queued loads, then stop the thread (waits at most ``timeout_s``)."""
        self._worker.close(timeout_s)

    def _load(self, spec: LoadSpec) -> None:
        try:
            failed = self._run(spec)
        except Exception:
            self.num_failed += 1
            _log.exception("kvmesh load of request %s failed; vLLM recomputes its blocks", spec.req_id)
            failed = self._blocks_of(spec)
        with self._lock:
            self._in_flight.discard(spec.req_id)
            self._done.setdefault(spec.req_id, set()).update(failed)
