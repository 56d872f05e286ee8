"""Stand-ins for a store host on loopback: one that never answers, one that answers slowly."""

from __future__ import annotations

import queue
import socket
import threading
import time


class _Listener:
    """Accepts connections on ``127.0.0.1:<port>`` on a thread and hands each to :meth:`_accepted`."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.05)
        self.port: int = self._sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.conns.append(conn)
            self._accepted(conn)

    def _accepted(self, conn: socket.socket) -> None:
        """Keep the connection open and never answer."""

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for conn in self.conns:
            conn.close()
        self._sock.close()


class BlackHole(_Listener):
    """A host that accepts connections and never answers (a hung store host)."""


class SlowLink(_Listener):
    """Relay to ``upstream`` with ``delay_s`` of latency on every reply.

    Requests pass at once; each piece of a reply is relayed ``delay_s`` after it arrived, pieces in
    flight overlap (latency, not a bandwidth cap), so every round trip takes at least ``delay_s``
    and a large reply about ``delay_s`` more than it would.
    """

    def __init__(self, upstream: tuple[str, int], delay_s: float) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        super().__init__()

    def _accepted(self, conn: socket.socket) -> None:
        server = socket.create_connection(self.upstream)
        self.conns.append(server)
        held: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
        threading.Thread(target=self._relay, args=(conn, server), daemon=True).start()
        threading.Thread(target=self._hold, args=(server, held), daemon=True).start()
        threading.Thread(target=self._release, args=(held, conn), daemon=True).start()

    @staticmethod
    def _relay(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 20):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            _shut(source, sink)

    def _hold(self, source: socket.socket, held: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        try:
            while data := source.recv(1 << 20):
                held.put((time.monotonic() + self.delay_s, data))
        except OSError:
            pass
        held.put((0.0, b""))

    @staticmethod
    def _release(held: queue.SimpleQueue[tuple[float, bytes]], sink: socket.socket) -> None:
        try:
            while True:
                due, data = held.get()
                if not data:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                sink.sendall(data)
        except OSError:
            pass
        finally:
            _shut(sink)


def _shut(*conns: socket.socket) -> None:
    for conn in conns:
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
