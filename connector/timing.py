"""Where a step's connector time goes: seconds per part, reported as ``seconds.<part>`` stats and
exported as ``vllm:orbitkv_seconds_total{part}``.

Scheduler half: ``chunk`` (a new request's chunks: content ids of its text and images, made
once; ``mm_hash``, inside it, hashing the inputs of items not seen before), ``plan`` (match and plan a request), ``alloc`` (after vLLM allocated its blocks),
``meta`` (the step's loads and saves), ``output`` (the workers' report), ``finish`` (the request's
summary); the scheduler extension (``vllm_ext/hole_scheduler.py``) adds ``guard`` (the exact guard
around vLLM's prefix-cache lookup and after each step) and ``holes`` (jumps and caps). Worker half: ``fetch`` (the batched store read), ``check`` (verifying the entries against
the plan), ``layer_load`` (relocate, patch and scatter, summed over layers), ``save_gather`` (copying
saved chunks out of the paged cache, over layers, on the forward's path), ``save_submit`` (handing
them to the writer), ``save_wait`` (a step's start waiting for the last step's copy where it runs
between steps, ``worker/saving.py``); ``save_copy``: that copy's own time, on its thread;
``save_writer``: the writer thread's CPU seconds building and storing entries (off the forward
pass, on the same cores).
With one request at a time, a ``/metrics`` delta is that request's cost (``bench agent``'s floor row).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class PartSeconds:
    """Seconds per part since the last ``take``."""

    __slots__ = ("_seconds",)

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, time.perf_counter() - started)

    def add(self, part: str, seconds: float) -> None:
        self._seconds[part] = self._seconds.get(part, 0.0) + seconds

    def take(self) -> dict[str, float]:
        taken, self._seconds = self._seconds, {}
        return {f"seconds.{part}": s for part, s in taken.items()}
