"""Background writes to one tier through a bounded queue.

``submit`` never blocks the caller (the forward pass or the promotion path): when the queue is full
the OLDEST queued write is dropped and counted, because a newer write is more likely to be read
soon. Writer threads drain the queue in batches so a remote tier sees one round trip per batch.

The queue is bounded twice: by jobs (``queue_depth``) and by the bytes it holds
(``max_queue_nbytes``: the values queued plus those of the batches being written). A slow tier
with large entries would otherwise hold ``queue_depth`` entries of any size (1,024 chunks of 32 MiB
is 32 GiB). Over the byte cap the oldest queued writes are dropped; when only writes in flight hold
the bytes the new write itself is dropped (``dropped_nbytes`` counts both). A single write larger
than the cap is still taken when nothing else is held, so the bound is ``max(cap, one value)``.

A job is ``(key, value, antecedent, is_refresh)``: a put of ``value``; or (``value`` None) an
addition of ``antecedent`` to the per-CID survivor index under ``key``, which goes to the backend's
atomic ``batch_index_add`` (see ``antecedents.py``), so concurrent writers never lose an addition;
or a refresh: an upper tier served ``key``, so the backend marks it used (``batch_touch``) and,
when it no longer holds it (a Redis that restarted empty), gets ``value`` back, with the entry's
``antecedent`` in its index.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, deque

from . import base
from .antecedents import Antecedent
from .background import lower_this_thread
from .base import Backend, Stats
from .keys import EntryKey
from .keys import index_key as cid_index_key

DROPPED_NBYTES = "dropped_nbytes"


def _nbytes(value: object) -> int:
    """What a queued value holds: its bytes (an index addition's few names are not counted)."""
    if value is None:
        return 0
    return len(value) if isinstance(value, bytes) else memoryview(value).nbytes


def index_key(entry_key: str) -> str:
    """The survivor index key of the CID an entry key names."""
    return cid_index_key(EntryKey.parse(entry_key).cid)


class WriteBehind:
    def __init__(
        self,
        backend: Backend,
        *,
        num_threads: int = 1,
        queue_depth: int = 1024,
        max_batch: int = 16,
        max_antecedents: int = 32,
        max_queue_nbytes: int | None = None,
    ) -> None:
        if num_threads < 1 or queue_depth < 1 or max_batch < 1:
            raise ValueError("num_threads, queue_depth and max_batch must be >= 1")
        self.backend = backend
        self.queue_depth = queue_depth
        self.max_batch = max_batch
        self.max_antecedents = max_antecedents
        self.max_queue_nbytes = max_queue_nbytes
        self.counters = Stats("queue.")
        self.counters.add(DROPPED_NBYTES, 0)
        self._jobs: deque[tuple[str, object, Antecedent | None, bool]] = deque()
        self._held_nbytes = 0  # values queued or in flight
        self._pending_keys: Counter[str] = Counter()  # keys queued or in flight
        self._peak_nbytes = 0
        self._cond = threading.Condition()
        self._num_in_flight = 0
        self._is_closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"orbitkv-{backend.name}-writer-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def submit(
        self,
        key: str,
        value: object,
        antecedent: Antecedent | None = None,
        *,
        is_refresh: bool = False,
    ) -> None:
        """Queue a put of ``value`` (bytes-like), with ``value=None`` an index addition, or with
        ``is_refresh`` a refresh (see the module docstring)."""
        with self._cond:
            if self._is_closed:
                self.counters.add(base.DROPPED_WRITES)
                return
            if len(self._jobs) >= self.queue_depth:
                self._drop_oldest()
            nbytes = _nbytes(value)
            cap = self.max_queue_nbytes
            if cap is not None:
                while self._jobs and self._held_nbytes + nbytes > cap:
                    self._drop_oldest()
                if self._held_nbytes and self._held_nbytes + nbytes > cap:
                    self.counters.add(base.DROPPED_WRITES)
                    self.counters.add(DROPPED_NBYTES, nbytes)
                    return
            self._jobs.append((key, value, antecedent, is_refresh))
            self._pending_keys[key] += 1
            self._held_nbytes += nbytes
            self._peak_nbytes = max(self._peak_nbytes, self._held_nbytes)
            self._cond.notify()

    def _drop_oldest(self) -> None:
        key, value, _, _ = self._jobs.popleft()
        self._forget(key)
        self._held_nbytes -= _nbytes(value)
        self.counters.add(base.DROPPED_WRITES)
        self.counters.add(DROPPED_NBYTES, _nbytes(value))

    def _take(self) -> list[tuple[str, object, Antecedent | None, bool]] | None:
        with self._cond:
            while not self._jobs and not self._is_closed:
                self._cond.wait()
            if not self._jobs:
                return None
            batch = [self._jobs.popleft() for _ in range(min(self.max_batch, len(self._jobs)))]
            self._num_in_flight += 1
            return batch

    def _run(self) -> None:
        lower_this_thread()
        while (batch := self._take()) is not None:
            try:
                self._write(batch)
            except Exception:  # a writer thread must survive any backend bug
                self.counters.add(base.ERRORS)
            finally:
                with self._cond:
                    self._num_in_flight -= 1
                    self._held_nbytes -= sum(_nbytes(job[1]) for job in batch)
                    for job in batch:
                        self._forget(job[0])
                    self._cond.notify_all()

    def _write(self, batch: list[tuple[str, object, Antecedent | None, bool]]) -> None:
        refreshes = [(k, v, a) for k, v, a, is_refresh in batch if is_refresh]
        puts = [(k, v) for k, v, _, is_refresh in batch if v is not None and not is_refresh]
        additions = [(k, a) for k, v, a, _ in batch if v is None and a is not None]
        if refreshes:
            present = self.backend.batch_touch([k for k, _, _ in refreshes])
            lost = [job for job, is_there in zip(refreshes, present, strict=True) if not is_there]
            puts += [(k, v) for k, v, _ in lost]
            additions += [(index_key(k), a) for k, _, a in lost if a is not None]
            self.counters.add("refreshed", len(refreshes))
            self.counters.add("refilled", len(lost))
        if puts:
            self.backend.batch_put(puts)
        if additions:
            self.backend.batch_index_add(additions, self.max_antecedents)
        self.counters.add("written_jobs", len(batch))

    def _forget(self, key: str) -> None:
        if self._pending_keys[key] <= 1:
            del self._pending_keys[key]
        else:
            self._pending_keys[key] -= 1

    def has_pending(self, keys: list[str]) -> bool:
        """Whether a write of any of ``keys`` is queued or in flight (never waits)."""
        with self._cond:
            return any(k in self._pending_keys for k in keys)

    @property
    def depth(self) -> int:
        return len(self._jobs)

    @property
    def held_nbytes(self) -> int:
        """Bytes of the values queued or being written now."""
        return self._held_nbytes

    @property
    def peak_nbytes(self) -> int:
        """The most bytes ever held at once."""
        return self._peak_nbytes

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
        self.counters.set_gauge("held_nbytes", self._held_nbytes)
        self.counters.set_gauge("peak_nbytes", self._peak_nbytes)
        return self.counters.snapshot()


class RecentKeys:
    """Which keys are due a refresh: each at most once per ``interval_s``, a bounded table."""

    def __init__(self, interval_s: float, max_keys: int = 1 << 16) -> None:
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._last: OrderedDict[str, float] = OrderedDict()

    def take_due(self, keys: list[str]) -> set[str]:
        now = time.monotonic()
        due = set()
        with self._lock:
            for key in keys:
                last = self._last.get(key)
                if last is not None and now - last < self.interval_s:
                    continue
                due.add(key)
                self._last[key] = now
                self._last.move_to_end(key)
            while len(self._last) > self.max_keys:
                self._last.popitem(last=False)
        return due
