"""Background writes to one tier through a bounded queue.

``submit`` never blocks the caller (the forward pass or the promotion path): when the queue is full
the OLDEST queued write is dropped and counted, because a newer write is more likely to be read
soon. Writer threads drain the queue in batches so a remote tier sees one round trip per batch.

A job is ``(key, value, merge)``. With ``merge`` set, the job is a read-modify-write (the per-CID
antecedent index): the writer reads the current value in the same batch and stores
``merge(current_or_None)``. Merges are serialized within this process; across processes (a shared
Redis) two concurrent merges of one key can lose one addition, which the survivor index tolerates
(it is a hint, and the next conditioned put of that antecedent adds it again).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from . import base
from .base import Backend, Stats

Merge = Callable[[bytes | None], bytes | None]


class WriteBehind:
    def __init__(
        self,
        backend: Backend,
        *,
        num_threads: int = 1,
        queue_depth: int = 1024,
        max_batch: int = 16,
    ) -> None:
        if num_threads < 1 or queue_depth < 1 or max_batch < 1:
            raise ValueError("num_threads, queue_depth and max_batch must be >= 1")
        self.backend = backend
        self.queue_depth = queue_depth
        self.max_batch = max_batch
        self.counters = Stats("queue.")
        self._jobs: deque[tuple[str, bytes | None, Merge | None]] = deque()
        self._cond = threading.Condition()
        self._merge_lock = threading.Lock()
        self._num_in_flight = 0
        self._is_closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"orbitkv-{backend.name}-writer-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, key: str, value: bytes | None, merge: Merge | None = None) -> None:
        with self._cond:
            if self._is_closed:
                self.counters.add(base.DROPPED_WRITES)
                return
            if len(self._jobs) >= self.queue_depth:
                self._jobs.popleft()
                self.counters.add(base.DROPPED_WRITES)
            self._jobs.append((key, value, merge))
            self._cond.notify()

    def _take(self) -> list[tuple[str, bytes | None, Merge | None]] | None:
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

    def _write(self, batch: list[tuple[str, bytes | None, Merge | None]]) -> None:
        puts = [(k, v) for k, v, m in batch if m is None and v is not None]
        if puts:
            self.backend.batch_put(puts)
        merges = [(k, m) for k, _, m in batch if m is not None]
        if merges:
            # Writer threads would otherwise lose each other's read-modify-writes of one key.
            with self._merge_lock:
                merge_keys = [k for k, _ in merges]
                current = dict(zip(merge_keys, self.backend.batch_get(merge_keys), strict=True))
                for key, merge in merges:
                    current[key] = merge(current[key])  # merges of one key in a batch compose
                self.backend.batch_put([(k, v) for k, v in current.items() if v is not None])
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
