"""Child processes of a fleet: started in their own process group, logged to a file, stopped for sure.

Each child leads a new session (``start_new_session``), so stopping it signals its whole process
group: SIGTERM first, SIGKILL after a grace period. On Linux a child also receives SIGTERM when the
thread that started it dies (``PR_SET_PDEATHSIG``), so a killed launcher leaves no orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from kvmesh.errors import FleetError

_PR_SET_PDEATHSIG = 1
_EXCEPTION_LINE = re.compile(r"\b[A-Z]\w*(?:Error|Exception|Exit)\b: ")
_MAX_CAUSES = 6
_TAIL_LINES = 30


def exception_lines(lines: Sequence[str]) -> list[str]:
    """The distinct ``SomethingError: message`` lines of a log, first seen first.

    A child's last lines often name only a wrapper (vLLM's "Engine core initialization failed. See
    root cause above"); the exceptions raised before it are what a reader needs.
    """
    seen: dict[str, None] = {}
    for line in lines:
        match = _EXCEPTION_LINE.search(line)
        if match is not None:
            seen.setdefault(line[match.start() :].strip(), None)
    return list(seen)[:_MAX_CAUSES]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ManagedProcess:
    """One child process with its log file.

    Args:
        name: short name used in logs and errors (``engine-0``, ``router``, ``redis``).
        argv: the command.
        log_path: stdout and stderr go here (appended).
    """

    def __init__(
        self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def start(self) -> None:
        """Spawn the process (must be called from the thread that will outlive it)."""
        assert self._proc is None, f"{self.name} started twice"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            try:
                self._proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            except OSError as exc:
                raise FleetError(f"cannot start {self.name} ({self.argv[0]}): {exc}") from exc

    def _log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []

    def log_tail(self, num_lines: int = _TAIL_LINES) -> str:
        return "\n".join(self._log_lines()[-num_lines:])

    def exit_report(self) -> str:
        """The exceptions a log names (root causes first), then its tail."""
        lines = self._log_lines()
        causes = exception_lines(lines)
        head = "exceptions in the log:\n  " + "\n  ".join(causes) + "\nlog tail:\n" if causes else ""
        return head + "\n".join(lines[-_TAIL_LINES:])

    def check_alive(self) -> None:
        """Raise :class:`FleetError` with the log's exceptions and tail when the process has exited."""
        code = self.returncode
        if code is not None:
            raise FleetError(
                f"{self.name} exited with code {code}; log {self.log_path}:\n{self.exit_report()}"
            )

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(sig)

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; returns the exit code."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self._proc.wait, grace_s)
        # the leader may be gone while members of its group are not: kill the group regardless
        self._signal_group(signal.SIGKILL)
        if self._proc.poll() is None:
            await asyncio.sleep(0.05)
            self._proc.wait(timeout=5)
        return self._proc.returncode

    def stop_now(self) -> None:
        """Synchronous SIGKILL of the group (for interpreter exit paths)."""
        self._signal_group(signal.SIGKILL)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)


async def wait_until(
    proc: ManagedProcess, probe: Callable[[], Awaitable[bool]], timeout_s: float, what: str
) -> None:
    """Poll ``probe`` until it returns True; fail early if ``proc`` exits, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        proc.check_alive()
        if await probe():
            return
        if time.monotonic() > deadline:
            raise FleetError(
                f"{proc.name} not ready ({what}) after {timeout_s:.0f}s; log {proc.log_path}:\n{proc.log_tail()}"
            )
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def http_probe(session: aiohttp.ClientSession, url: str) -> Callable[[], Awaitable[bool]]:
    """A probe that is True when ``GET url`` answers 200."""

    async def probe() -> bool:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    return probe


async def probe_json(session: aiohttp.ClientSession, url: str) -> tuple[bool, Any]:
    """``(True, body)`` when ``GET url`` answers 200 with JSON within 2 s; ``(False, None)`` when it
    does not (not up yet: refused, timed out, another status, or not JSON)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
            if resp.status != 200:
                return False, None
            return True, await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return False, None


def all_healthy_probe(session: aiohttp.ClientSession, url: str) -> Callable[[], Awaitable[bool]]:
    """A probe that is True when ``GET url`` answers 200 and, where the body counts endpoints
    (``{"endpoints": n, "healthy": h}``, the router's /health), every endpoint is healthy."""

    async def probe() -> bool:
        answered, body = await probe_json(session, url)
        if not answered:
            return False
        if isinstance(body, dict) and isinstance(body.get("endpoints"), int):
            return body.get("healthy") == body["endpoints"]
        return True

    return probe


def tcp_probe(host: str, port: int) -> Callable[[], Awaitable[bool]]:
    """A probe that is True when a TCP connection to ``host:port`` succeeds."""

    async def probe() -> bool:
        try:
            _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=1)
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    return probe
