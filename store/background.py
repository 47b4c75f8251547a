"""Background threads that yield the cores to the forward pass.

vLLM-CPU binds its OpenMP threads to every core; a parallel region then waits for the slowest of
its threads, so a background thread that takes a core from one of them for a time slice stalls
the whole region. Writers, encoders and patch formers lower their own thread's priority (Linux
nice is per thread) so that the scheduler runs them in the forward's gaps.
"""

from __future__ import annotations

import os
import threading

BACKGROUND_NICE_INCREMENT = 10


def lower_this_thread() -> None:
    """Lower the calling thread's scheduling priority (no-op where the OS does not allow it)."""
    try:
        tid = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + BACKGROUND_NICE_INCREMENT))
    except (AttributeError, OSError):
        pass
