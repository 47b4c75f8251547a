"""The engine's forward as a gate for the background writer.

On a CPU engine vLLM's OpenMP threads hold every core through a forward, and any other thread of
the process that runs then takes its time from them (and, holding the GIL, from the forward's
Python between two layers). A save handed to the writer during a step (the encoder connector's
outputs, before the forward) was built and stored while the forward ran: measured on the demo's
tiny model, the forwards that ran beside it took about 0.9 ms more than those of the same server
without the encoder connector (issue 26). So the worker closes the gate when a step starts
(``begin_forward``) and opens it when the forward is done (``end_forward``), and the writer starts
a job only while the gate is open, or once the job has waited ``max_hold_s`` (an engine whose
steps never leave a gap still saves). A job submitted during the forward reaches the writer's
thread only at its end (``SaveWriter.end_forward``): waking the thread earlier cost the forward a
context switch and a GIL hand-off, for a job that would only wait. On a GPU the forward's cores
are free, but the GIL is not: the same gate keeps the writer's Python out of the kernel launches.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class ForwardGate:
    """Open between forwards; ``wait_for_gap`` blocks the caller while closed, for a bounded
    time. The engine's side costs an attribute write a step (a notify only while a job waits)."""

    __slots__ = ("max_hold_s", "_is_open", "_num_waiting", "_num_bypass", "_cond",
                 "num_held", "num_forced", "held_s")

    def __init__(self, max_hold_s: float = 1.0) -> None:
        if max_hold_s < 0:
            raise ValueError(f"max_hold_s must be >= 0, got {max_hold_s}")
        # 0: never hold (the writer starts a job at once, as before the gate).
        self.max_hold_s = max_hold_s
        self._is_open = True
        self._num_waiting = 0
        self._num_bypass = 0
        self._cond = threading.Condition()
        self.num_held = 0  # jobs that waited for a forward to end
        self.num_forced = 0  # of those, jobs that ran during a forward after max_hold_s
        self.held_s = 0.0

    @property
    def is_holding(self) -> bool:
        """A forward runs and jobs wait for its end (False when holding is off)."""
        return not self._is_open and self.max_hold_s > 0

    def begin_forward(self) -> None:
        self._is_open = False

    def end_forward(self) -> None:
        self._is_open = True
        if self._num_waiting:
            with self._cond:
                self._cond.notify_all()

    def wait_for_gap(self, since: float) -> float:
        """Wait while a forward runs, until ``since + max_hold_s`` (``time.perf_counter``) at the
        latest; the seconds waited."""
        if self._is_open or self._num_bypass or self.max_hold_s <= 0:
            return 0.0
        started = time.perf_counter()
        deadline = since + self.max_hold_s
        with self._cond:
            self._num_waiting += 1
            try:
                # Checked under the lock: ``end_forward`` notifies under it, so no wake is lost.
                while not self._is_open and not self._num_bypass:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        self.num_forced += 1
                        break
                    self._cond.wait(left)
            finally:
                self._num_waiting -= 1
        waited = time.perf_counter() - started
        self.num_held += 1
        self.held_s += waited
        return waited

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """No job waits inside the block (a flush must not wait for the engine)."""
        with self._cond:
            self._num_bypass += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._num_bypass -= 1
