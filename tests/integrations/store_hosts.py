"""Stand-ins for a store host on loopback: one that never answers, one that answers slowly."""

from __future__ import annotations

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
    """Relay to ``upstream``, delaying each reply by ``delay_s``.

    Requests pass at once; what the upstream sends back waits ``delay_s`` before it is relayed,
    so every round trip through the link takes at least that long.
    """

    def __init__(self, upstream: tuple[str, int], delay_s: float) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        super().__init__()

    def _accepted(self, conn: socket.socket) -> None:
        server = socket.create_connection(self.upstream)
        self.conns.append(server)
        threading.Thread(target=self._pump, args=(conn, server, 0.0), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, conn, self.delay_s), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, delay_s: float) -> None:
        try:
            while data := source.recv(1 << 20):
                if delay_s:
                    time.sleep(delay_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for conn in (source, sink):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
