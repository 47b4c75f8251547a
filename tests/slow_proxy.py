"""A loopback TCP proxy that slows a real server down: a bandwidth cap and a delay per chunk.

    with SlowProxy(server.port, nbytes_per_s=20 << 20) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}"   # the same Redis, behind a 20 MiB/s link

Both directions are forwarded by their own thread per connection, each chunk (at most 64 KiB)
held for ``delay_s`` plus its bytes at ``nbytes_per_s``: a slow network, not a frozen server.
``set_rate`` changes the link while connections are open.
"""

from __future__ import annotations

import socket
import threading
import time

CHUNK_NBYTES = 64 << 10


class SlowProxy:
    def __init__(self, target_port: int, *, nbytes_per_s: float | None = None,
                 delay_s: float = 0.0) -> None:
        self.target_port = target_port
        self.nbytes_per_s = nbytes_per_s
        self.delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._is_closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="slow-proxy", daemon=True)
        self._thread.start()

    def set_rate(self, nbytes_per_s: float | None, delay_s: float = 0.0) -> None:
        self.nbytes_per_s = nbytes_per_s
        self.delay_s = delay_s

    def _accept(self) -> None:
        while not self._is_closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(CHUNK_NBYTES)
                if not data:
                    break
                rate = self.nbytes_per_s
                pause = self.delay_s + (len(data) / rate if rate else 0.0)
                if pause:
                    time.sleep(pause)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._is_closed = True
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> SlowProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
