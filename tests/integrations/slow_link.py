"""A TCP relay that holds every reply for a while: a store host that answers, slowly."""

from __future__ import annotations

import socket
import threading
import time


class SlowLink:
    """Relay ``127.0.0.1:<port>`` to ``upstream``, delaying each reply by ``delay_s``.

    Requests pass at once; what the upstream sends back waits ``delay_s`` before it is relayed,
    so every round trip through the link takes at least that long.
    """

    def __init__(self, upstream: tuple[str, int], delay_s: float) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.05)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.delay_s), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, delay_s: float) -> None:
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

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for conn in self._conns:
            conn.close()
        self._sock.close()
