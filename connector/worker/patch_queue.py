"""Patch formation off the forward's critical path: a low-priority queue, one job at a time.

Forming a patch (relocate the canonical, subtract, truncated SVD, the orbit mean) is a burst of
BLAS work. On the forward's own cores it competes with the next steps (measured: the bench's
patched arm 1.65x slower than the plain one when patches were formed with each save). So the
save path only queues the job (its inputs are already gathered) and this thread forms it when the
engine has been idle for ``idle_s`` (the worker stamps every step), or, on an engine that never
idles, once the job has waited ``max_delay_s``: at most one job per step then. A full queue drops
the job (a patch not formed is a future recompute, never an error); ``flush`` forms everything now.
Full means ``max_jobs`` jobs, or ``max_nbytes`` of inputs held (queued or being formed): a job
holds its chunk's gathered KV, so the bytes are what bound the memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orbitkv.store.tiered import TieredStore

from orbitkv.store.background import lower_this_thread

logger = logging.getLogger(__name__)

# A job returns the (key, entry) pairs to store.
PatchJob = Callable[[], list[tuple[str, Any]]]


@dataclass(frozen=True, slots=True)
class PatchLimits:
    """When queued jobs are formed (``idle_s``, ``max_delay_s``) and how many the queue holds."""

    idle_s: float = 0.05
    max_delay_s: float = 5.0
    max_jobs: int = 256
    max_nbytes: int | None = None


class PatchQueue:
    def __init__(
        self, store: TieredStore, *, idle_s: float = 0.05, max_delay_s: float = 5.0,
        max_jobs: int = 256,
        max_nbytes: int | None = None,
        on_stored: Callable[[list[tuple[str, Any]]], None] | None = None,
    ) -> None:
        self._store = store
        self._idle_s = idle_s
        self._max_delay_s = max_delay_s
        self._max_jobs = max_jobs
        self._on_stored = on_stored
        self._max_nbytes = max_nbytes
        self._jobs: deque[tuple[float, PatchJob, int]] = deque()
        self.held_nbytes = 0  # inputs of the jobs queued or being formed
        self.peak_nbytes = 0
        self._cond = threading.Condition()
        self._last_step_at = 0.0
        self._is_busy = False
        self._is_closed = False
        self._is_flushing = 0
        self.num_formed = 0
        self.num_dropped = 0
        self.num_failed = 0
        self._thread = threading.Thread(target=self._run, name="orbitkv-patches", daemon=True)
        self._thread.start()

    # -- the engine's clock -------------------------------------------------------------------------

    def mark_step(self) -> None:
        """The engine ran a step just now (the worker calls this twice a step). The former needs
        waking only while it holds jobs (their wait for an idle engine or their longest wait is
        measured from here); with none it sleeps until ``submit``. Waking it on every step was
        two context switches a step on the forward's core, for nothing on most steps."""
        self._last_step_at = time.monotonic()
        if self._jobs:
            with self._cond:
                self._cond.notify_all()

    # -- jobs ---------------------------------------------------------------------------------------

    def submit(self, job: PatchJob, nbytes: int = 0) -> bool:
        """Queue ``job``, which holds ``nbytes`` of inputs until formed; False when the queue is
        full (in jobs or bytes) and the job is dropped."""
        with self._cond:
            is_over_nbytes = (
                self._max_nbytes is not None
                and self.held_nbytes > 0
                and self.held_nbytes + nbytes > self._max_nbytes
            )
            if len(self._jobs) >= self._max_jobs or is_over_nbytes:
                self.num_dropped += 1
                logger.warning("OrbitKV: patch queue full; a patch is not formed")
                return False
            self._jobs.append((time.monotonic(), job, nbytes))
            self.held_nbytes += nbytes
            self.peak_nbytes = max(self.peak_nbytes, self.held_nbytes)
            self._cond.notify_all()
            return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Form every queued job now (tests, shutdown), and wait until they are stored; False
        when ``timeout_s`` passed first (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._is_flushing += 1
            self._cond.notify_all()
            try:
                while (self._jobs or self._is_busy) and not self._is_closed:
                    left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                    if left <= 0:
                        return False
                    self._cond.wait(left)
            finally:
                self._is_flushing -= 1
        return True

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._is_closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    @property
    def num_pending(self) -> int:
        with self._cond:
            return len(self._jobs)

    def _is_due(self, now: float) -> bool:
        queued_at = self._jobs[0][0]
        return (
            self._is_flushing > 0
            or now - self._last_step_at >= self._idle_s
            or now - queued_at >= self._max_delay_s
        )

    def _next_job(self) -> tuple[PatchJob, int] | None:
        with self._cond:
            while not self._is_closed:
                now = time.monotonic()
                if self._jobs and self._is_due(now):
                    _, job, nbytes = self._jobs.popleft()
                    self._is_busy = True
                    return job, nbytes
                self._cond.wait(self._idle_s if self._jobs else None)
            return None

    def _run(self) -> None:
        lower_this_thread()
        while (taken := self._next_job()) is not None:
            job, nbytes = taken
            taken = None
            try:
                items = job()
                if items:
                    self._store.put_many(items)
                    if self._on_stored is not None:
                        self._on_stored(items)
                self.num_formed += len(items)
            except Exception:
                self.num_failed += 1
                logger.exception("OrbitKV: forming a patch failed")
            finally:
                job = items = None  # the inputs go before their bytes are released
                with self._cond:
                    self.held_nbytes -= nbytes
                    self._is_busy = False
                    self._cond.notify_all()
