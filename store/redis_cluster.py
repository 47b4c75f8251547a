"""Redis Cluster batches, one pipeline per master, so that a node that is down costs only its keys.

redis-py's cluster pipeline runs a batch as one unit: when one master is unreachable the whole
``execute`` raises, and every key of the batch, on every node, becomes a miss. Here the keys are
grouped by the master that owns their slot, each group is one pipeline on that master's own
connection, and each master has its own circuit breaker: a dead node's keys are misses (its writes
dropped) while the others keep answering. A ``MOVED``/``ASK`` reply or a failed node makes the slot
map refresh itself; until then those keys are misses too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from redis.exceptions import ResponseError

from . import base, redis_deadline

# (pipeline, key) -> queues that key's commands on the pipeline.
AddCommands = Callable[[Any, str], None]


class Breaker:
    """Open after a failure for an exponentially growing back-off; one probe when it expires."""

    def __init__(self, backoff_s: float, max_backoff_s: float) -> None:
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._num_failures = 0
        self._closed_at = 0.0  # monotonic time when calls may go through again

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if now < self._closed_at:
                return False
            if self._num_failures:
                # Half-open: let this caller probe, hold the others back for one timeout's worth.
                self._closed_at = now + self.backoff_s
            return True

    def record(self, is_ok: bool) -> None:
        with self._lock:
            if is_ok:
                self._num_failures = 0
                self._closed_at = 0.0
                return
            self._num_failures += 1
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (self._num_failures - 1))
            self._closed_at = time.monotonic() + delay

    @property
    def is_up(self) -> bool:
        return self._num_failures == 0


class NodeBatches:
    """Per-master pipelines over a ``RedisCluster`` client (built lazily by ``get_client``)."""

    def __init__(self, get_client: Callable[[], Any], backoff_s: float, max_backoff_s: float,
                 counters: base.Stats) -> None:
        self._get_client = get_client
        self._backoff = (backoff_s, max_backoff_s)
        self._counters = counters
        self._lock = threading.Lock()
        self._breakers: dict[str, Breaker] = {}
        self._client_breaker = Breaker(backoff_s, max_backoff_s)

    def _breaker(self, name: str) -> Breaker:
        with self._lock:
            if name not in self._breakers:
                self._breakers[name] = Breaker(*self._backoff)
            return self._breakers[name]

    @property
    def is_up(self) -> bool:
        with self._lock:
            breakers = list(self._breakers.values())
        return self._client_breaker.is_up and all(b.is_up for b in breakers)

    def _fail(self, what: str) -> None:
        self._counters.add(base.ERRORS)
        self._counters.add(f"errors.{what}")

    def _client(self, what: str) -> Any | None:
        if not self._client_breaker.allow():
            self._counters.add("short_circuited")
            return None
        try:
            client = self._get_client()
        except Exception:  # no seed node answers: the whole tier is a miss for a back-off
            self._client_breaker.record(False)
            self._fail(what)
            return None
        self._client_breaker.record(True)
        return client

    def run(self, what: str, keys: Sequence[str], add: AddCommands, step: int,
            timeout_of: Callable[[list[str]], float]) -> list[list | None]:
        """Each key's ``step`` replies, or None where its node failed or was short-circuited;
        ``timeout_of`` bounds each master's call by its own keys (``redis_deadline``)."""
        out: list[list | None] = [None] * len(keys)
        client = self._client(what)
        if client is None or not keys:
            return out
        groups: dict[str, tuple[Any, list[int]]] = {}
        is_stale = False
        for i, key in enumerate(keys):
            try:
                node = client.get_node_from_key(key)
            except Exception:
                is_stale = True
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        for name, (node, idxs) in groups.items():
            breaker = self._breaker(name)
            if not breaker.allow():
                self._counters.add("short_circuited")
                continue
            group = [keys[i] for i in idxs]

            def fill(pipe, group=group) -> None:
                for key in group:
                    add(pipe, key)

            try:
                flat = redis_deadline.execute(
                    client.get_redis_connection(node), fill, timeout_of(group)
                )
            except Exception:  # this node only: its keys are misses, the others go on
                breaker.record(False)
                self._fail(what)
                is_stale = True
                continue
            breaker.record(True)
            for j, i in enumerate(idxs):
                part = flat[j * step : (j + 1) * step]
                if any(isinstance(r, ResponseError) and str(r).startswith(("MOVED", "ASK")) for r in part):
                    is_stale = True
                    continue
                out[i] = part
        if is_stale:
            self._refresh(client)
        return out

    def scan(self, match: str) -> Iterator[bytes | str]:
        """Every key matching ``match`` on every reachable master."""
        client = self._client("scan")
        if client is None:
            return
        for node in client.get_primaries():
            breaker = self._breaker(node.name)
            if not breaker.allow():
                continue
            try:
                keys = list(client.get_redis_connection(node).scan_iter(match=match, count=1000))
            except Exception:
                breaker.record(False)
                self._fail("scan")
                continue
            breaker.record(True)
            yield from keys

    def _refresh(self, client: Any) -> None:
        try:
            client.nodes_manager.initialize()
        except Exception:  # no node answers now; the next failure tries again
            pass
