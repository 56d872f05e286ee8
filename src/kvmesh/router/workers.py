"""``kvmesh router --workers N``: N gateway processes accepting on one port (``SO_REUSEPORT``).

One Python process tops out at one core, whatever the event loop; the kernel spreads new
connections over every socket bound with ``SO_REUSEPORT`` to the same address, so N processes
serve N cores with no proxy in front::

    supervisor ──spawn──► worker 0: Gateway (own event intake, index, scheduler) ─┐
               ──spawn──► worker 1: Gateway (own event intake, index, scheduler) ─┼─ listen :port
               ──spawn──► ...                                                    ─┘   (SO_REUSEPORT)

Each worker subscribes to every engine's event stream itself (ZMQ PUB fans out), so each holds the
whole index with its replay on reconnect and its seq-reset fencing; with ``--redis-index`` they
share one Redis/Valkey index instead. Metrics, admin changes and explanations are the whole
router's (:mod:`kvmesh.router.worker_mesh`). The supervisor starts a worker again when it exits on its
own (not faster than once per :data:`RESPAWN_BACKOFF_S`) and stops them all on SIGINT/SIGTERM.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

RESPAWN_BACKOFF_S = 1.0
"""A worker that exits is started again no sooner than this after its previous start."""

STOP_TIMEOUT_S = 10.0
"""How long stopping waits for a worker to exit before killing it."""

_POLL_S = 0.2
_RESEND_S = 1.0


@dataclass
class _Slot:
    index: int
    process: BaseProcess
    started_at: float
    num_restarts: int = field(default=0)


class WorkerSupervisor:
    """Runs ``target(index)`` in ``num_workers`` spawned processes and keeps them running.

    Args:
        target: the worker's body, a picklable module-level function; it gets the worker's index.
        num_workers: how many processes.

    Raises:
        ValueError: ``num_workers`` is below 1.
    """

    def __init__(self, target: Callable[[int], None], num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.target = target
        self.num_workers = num_workers
        # Forking a process that already imported the tokenizer's threads and uvloop is unsafe.
        self._ctx = multiprocessing.get_context("spawn")
        self._slots: list[_Slot] = []
        self._stopping = False

    def _spawn(self, index: int) -> BaseProcess:
        process = self._ctx.Process(
            target=_run_worker, args=(self.target, index), name=f"kvmesh-router-{index}"
        )
        # The child inherits an ignored SIGINT through exec, so a stop (or a Ctrl-C to the process
        # group) that comes while it is still importing cannot print a traceback from the middle of
        # an import; _run_worker takes SIGINT back, and stop() sends it again until the child exits.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            process.start()
        finally:
            signal.signal(signal.SIGINT, previous)
        return process

    def start(self) -> None:
        """Start every worker."""
        self._slots = [_Slot(i, self._spawn(i), time.monotonic()) for i in range(self.num_workers)]

    @property
    def pids(self) -> list[int | None]:
        """The workers' process ids, by index."""
        return [slot.process.pid for slot in self._slots]

    def check(self) -> int:
        """Start again each worker that has exited (backoff permitting).

        Returns:
            How many workers were started again.
        """
        restarted = 0
        now = time.monotonic()
        for slot in self._slots:
            if slot.process.is_alive() or self._stopping:
                continue
            if now - slot.started_at < RESPAWN_BACKOFF_S:
                continue
            print(
                f"kvmesh router: worker {slot.index} exited with {slot.process.exitcode}; starting it again",
                file=sys.stderr,
            )
            slot.process = self._spawn(slot.index)
            slot.started_at = now
            slot.num_restarts += 1
            restarted += 1
        return restarted

    def stop(self) -> None:
        """Ask every worker to stop (SIGINT: at once, with no drain, since none stays to take
        their clients; requests in flight finish), then wait."""
        self._stopping = True
        now = time.monotonic()
        deadline, next_send = now + STOP_TIMEOUT_S, now
        while (now := time.monotonic()) < deadline:
            alive = [slot.process for slot in self._slots if slot.process.is_alive()]
            if not alive:
                return
            if now >= next_send:
                # again each _RESEND_S: a worker still starting ignores SIGINT until _run_worker runs
                for process in alive:
                    if process.pid is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(process.pid, signal.SIGINT)
                next_send = now + _RESEND_S
            multiprocessing.connection.wait(
                [p.sentinel for p in alive], timeout=min(next_send, deadline) - now
            )
        for slot in self._slots:
            if slot.process.is_alive():
                slot.process.kill()
            slot.process.join()

    def run(self) -> int:
        """Start the workers, keep them running until SIGINT/SIGTERM, then stop them.

        Returns:
            0 (an exit code).
        """

        def on_signal(signum: int, frame: FrameType | None) -> None:
            self._stopping = True

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            while not self._stopping:
                time.sleep(_POLL_S)
                self.check()
        finally:
            self.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
        return 0


def _run_worker(target: Callable[[int], None], index: int) -> None:
    """A worker's body: SIGINT back to KeyboardInterrupt, which ends the worker quietly."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        target(index)
    except KeyboardInterrupt:
        sys.exit(0)


def worker_pids(supervisor_pid: int) -> list[int]:
    """The live workers of the ``kvmesh router --workers N`` process ``supervisor_pid``, oldest first
    (Linux: read from /proc; multiprocessing's resource tracker is not one)."""
    try:
        children = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children").read_text().split()
    except FileNotFoundError:
        return []
    pids: list[int] = []
    for child in children:
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmdline:
            pids.append(int(child))
    return sorted(pids)


def num_listening_sockets(port: int) -> int:
    """TCP sockets listening on ``port`` over IPv4 (Linux: /proc/net/tcp): one per worker that
    accepts on it."""
    suffix = f":{port:04X}"
    listening = "0A"
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for row in rows if (cols := row.split())[1].endswith(suffix) and cols[3] == listening)
