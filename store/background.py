"""Background threads that yield the cores to the forward pass.

vLLM-CPU binds its OpenMP threads to every core; a parallel region then waits for the slowest of
its threads, so a background thread that takes a core from one of them for a time slice stalls
the whole region. Writers, encoders and patch formers lower their own thread's priority (Linux
nice is per thread) so that the scheduler runs them in the forward's gaps.

vLLM binds each OpenMP thread to one core, its main thread (OpenMP thread 0) to the first, and a
thread inherits the affinity of the thread that starts it: every thread OrbitKV started in a
worker ran on core 0 alone (read back in a demo server: ``{0}``, where the process has ``{0, 1}``),
taking its time from the forward's thread 0 and from the main thread's Python between steps while
the other cores idled. So background threads also spread themselves over every core the process's
threads are allowed (``spread_this_thread``). In a worker, OrbitKV starts before vLLM binds its
OpenMP threads (the whole process is on the first core then), so the worker spreads them all again
at its first step (``spread_background_threads``).
"""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path

BACKGROUND_NICE_INCREMENT = 10

# Threads that called ``spread_this_thread``, for ``spread_background_threads``.
_spread_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_spread_lock = threading.Lock()


def lower_this_thread() -> None:
    """Lower the calling thread's scheduling priority (no-op where the OS does not allow it)."""
    try:
        tid = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + BACKGROUND_NICE_INCREMENT))
    except (AttributeError, OSError):
        pass


def process_cores() -> set[int]:
    """Every core some thread of this process may run on (the union of their affinities: in a vLLM
    CPU worker, the cores vLLM bound its OpenMP threads to)."""
    cores: set[int] = set()
    for status in Path("/proc/self/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # a thread that ended meanwhile
            continue
        for line in text.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                cores |= parse_cpu_list(line.partition(":")[2])
    return cores


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8,10-11"`` (Linux's list format) as a set of core ids."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def spread_this_thread() -> None:
    """Let the calling thread run on any core of this process's threads (no-op where the OS does
    not tell or allow it); ``spread_background_threads`` spreads it again later."""
    with _spread_lock:
        _spread_threads.add(threading.current_thread())
    _set_cores(0, process_cores())  # 0: the calling thread


def spread_background_threads() -> None:
    """Spread every live thread that called ``spread_this_thread`` over the process's cores as
    they are now (after vLLM bound its OpenMP threads)."""
    cores = process_cores()
    with _spread_lock:
        threads = [t for t in _spread_threads if t.is_alive() and t.native_id]
    for thread in threads:
        _set_cores(thread.native_id, cores)


def _set_cores(tid: int, cores: set[int]) -> None:
    try:
        if cores and cores != os.sched_getaffinity(tid):
            os.sched_setaffinity(tid, cores)
    except (AttributeError, OSError, ValueError):
        pass
