"""Redis calls bounded as a whole, with a bound that grows with the bytes they move.

A socket timeout bounds each ``recv``/``send``, not a call: a 64 MiB GET that trickles in at a few
MB/s never trips it (measured: 1.1 s under a 0.2 s timeout), and a timeout short enough for a
small call drops every large write (a 64 MiB SET under 0.1 s). So each pipeline runs on a
connection of its own with the socket timeout and a deadline both set to
``timeout_s + nbytes / min_nbytes_per_s``; one watchdog thread shuts the socket down when a call
overruns its deadline; the call then raises redis-py's ``TimeoutError`` (a miss, a dropped write).

The connection goes back to its pool only after the deadline is disarmed, so the watchdog can never
shut down a socket that another call has taken from the pool meanwhile.
"""

from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import redis


def call_timeout_s(timeout_s: float, nbytes: int, min_nbytes_per_s: float) -> float:
    """What a call moving ``nbytes`` may take: the base timeout plus its bytes at the slowest rate
    the network is assumed to give."""
    return timeout_s + nbytes / min_nbytes_per_s


class Watchdog:
    """One daemon thread that shuts down the sockets of calls past their deadline."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, Any] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.num_fired = 0

    def arm(self, deadline: float, sock: Any) -> int:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="orbitkv-redis-deadlines",
                                                daemon=True)
                self._thread.start()
            token = next(self._ids)
            self._armed[token] = sock
            heapq.heappush(self._heap, (deadline, token))
            self._cond.notify()
            return token

    def disarm(self, token: int) -> bool:
        """False when the deadline has fired already (the socket is shut)."""
        with self._cond:
            return self._armed.pop(token, None) is not None

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._armed:
                    heapq.heappop(self._heap)  # finished in time
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, token = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._heap)
                sock = self._armed.pop(token)
                self.num_fired += 1
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed


WATCHDOG = Watchdog()


class _Held:
    """The pool a pipeline hands its connection back to: nobody. The caller releases it."""

    def release(self, connection: Any) -> None:
        pass


_HELD = _Held()


def execute(client: Any, fill: Callable[[Any], None], timeout_s: float) -> list:
    """Run the commands ``fill`` queues as one pipeline on ``client`` (a ``redis.Redis``), the
    whole call bounded by ``timeout_s``; raises what redis-py raises (a timeout, a shut socket)."""
    pipe = client.pipeline(transaction=False)
    fill(pipe)
    pool = client.connection_pool
    conn = pool.get_connection()
    token = None
    try:
        pipe.connection, pipe.connection_pool = conn, _HELD
        sock = getattr(conn, "_sock", None)  # redis-py's socket: no public accessor
        if sock is not None:
            sock.settimeout(timeout_s)  # each send/recv; the watchdog bounds the whole call
            token = WATCHDOG.arm(time.monotonic() + timeout_s, sock)
        return pipe.execute(raise_on_error=False)
    except redis.exceptions.ConnectionError as exc:
        if token is None or WATCHDOG.disarm(token):
            raise
        token = None
        conn.disconnect()
        # The watchdog shut the socket: report a timeout, as a socket timeout would have been.
        raise redis.exceptions.TimeoutError(f"call past its {timeout_s:.3g} s bound") from exc
    finally:
        if token is not None and not WATCHDOG.disarm(token):
            conn.disconnect()  # fired as the call ended: never hand a shut socket to the pool
        pool.release(conn)
