"""Background writes to one tier through a bounded queue.

``submit`` never blocks the caller (the forward pass or the promotion path): when the queue is full
the OLDEST queued write is dropped and counted, because a newer write is more likely to be read
soon. Writer threads drain the queue in batches so a remote tier sees one round trip per batch.

A job is ``(key, value, antecedent)``: a put of ``value``, or (``value`` None) an addition of
``antecedent`` to the per-CID survivor index under ``key``, which goes to the backend's atomic
``batch_index_add`` (see ``antecedents.py``), so concurrent writers never lose an addition.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from . import base
from .antecedents import Antecedent
from .base import Backend, Stats


class WriteBehind:
    def __init__(
        self,
        backend: Backend,
        *,
        num_threads: int = 1,
        queue_depth: int = 1024,
        max_batch: int = 16,
        max_antecedents: int = 32,
    ) -> None:
        if num_threads < 1 or queue_depth < 1 or max_batch < 1:
            raise ValueError("num_threads, queue_depth and max_batch must be >= 1")
        self.backend = backend
        self.queue_depth = queue_depth
        self.max_batch = max_batch
        self.max_antecedents = max_antecedents
        self.counters = Stats("queue.")
        self._jobs: deque[tuple[str, object, Antecedent | None]] = deque()
        self._cond = threading.Condition()
        self._num_in_flight = 0
        self._is_closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"orbitkv-{backend.name}-writer-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, key: str, value: object, antecedent: Antecedent | None = None) -> None:
        """Queue a put of ``value`` (bytes-like), or with ``value=None`` an index addition."""
        with self._cond:
            if self._is_closed:
                self.counters.add(base.DROPPED_WRITES)
                return
            if len(self._jobs) >= self.queue_depth:
                self._jobs.popleft()
                self.counters.add(base.DROPPED_WRITES)
            self._jobs.append((key, value, antecedent))
            self._cond.notify()

    def _take(self) -> list[tuple[str, object, Antecedent | None]] | None:
        with self._cond:
            while not self._jobs and not self._is_closed:
                self._cond.wait()
            if not self._jobs:
                return None
            batch = [self._jobs.popleft() for _ in range(min(self.max_batch, len(self._jobs)))]
            self._num_in_flight += 1
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            try:
                self._write(batch)
            except Exception:  # a writer thread must survive any backend bug
                self.counters.add(base.ERRORS)
            finally:
                with self._cond:
                    self._num_in_flight -= 1
                    self._cond.notify_all()

    def _write(self, batch: list[tuple[str, object, Antecedent | None]]) -> None:
        puts = [(k, v) for k, v, _ in batch if v is not None]
        if puts:
            self.backend.batch_put(puts)
        additions = [(k, a) for k, v, a in batch if v is None and a is not None]
        if additions:
            self.backend.batch_index_add(additions, self.max_antecedents)
        self.counters.add("written_jobs", len(batch))

    @property
    def depth(self) -> int:
        return len(self._jobs)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write has reached the backend; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._jobs or self._num_in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=left)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s)
        with self._cond:
            self._is_closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=timeout_s)

    def stats(self) -> dict[str, float]:
        self.counters.set_gauge("depth", len(self._jobs))
        return self.counters.snapshot()
