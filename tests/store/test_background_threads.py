"""Background threads (``store/background.py``): a thread started from one bound to a single core
(vLLM's main thread in a CPU worker) spreads itself over every core of the process's threads."""

from __future__ import annotations

import os
import threading

import pytest
from orbitkv.store.background import (
    parse_cpu_list,
    process_cores,
    spread_background_threads,
    spread_this_thread,
)


def test_linux_cpu_lists_parse():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}


def _affinity_in_thread(target) -> set[int]:
    out: list[set[int]] = []
    thread = threading.Thread(target=lambda: out.append(target()))
    thread.start()
    thread.join()
    return out[0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_thread_started_from_a_pinned_thread_spreads_over_the_process_cores():
    everywhere = os.sched_getaffinity(0)
    first = min(everywhere)

    def pinned_parent() -> set[int]:
        os.sched_setaffinity(0, {first})  # as vLLM binds its main thread
        try:
            inherited = _affinity_in_thread(lambda: os.sched_getaffinity(0))
            assert inherited == {first}  # what a plain thread gets

            def spread() -> set[int]:
                spread_this_thread()
                return os.sched_getaffinity(0)

            return _affinity_in_thread(spread)
        finally:
            os.sched_setaffinity(0, everywhere)

    spread = _affinity_in_thread(pinned_parent)
    # This test's main thread keeps every core, so the process's union is all of them.
    assert spread == process_cores() == everywhere


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_threads_started_while_the_process_was_on_one_core_spread_later(monkeypatch):
    """As in a vLLM worker: OrbitKV's threads start while every thread is on the first core; once
    vLLM has bound its OpenMP threads to the others, ``spread_background_threads`` widens them."""
    from orbitkv.store import background

    everywhere = os.sched_getaffinity(0)
    first = min(everywhere)
    cores_now = {first}  # what the process's threads allow, together: one core at OrbitKV's start
    monkeypatch.setattr(background, "process_cores", lambda: set(cores_now))
    started, release = threading.Event(), threading.Event()
    seen: list[set[int]] = []

    def background_thread() -> None:
        os.sched_setaffinity(0, {first})  # inherited from the thread that started it
        spread_this_thread()
        seen.append(os.sched_getaffinity(0))
        started.set()
        release.wait(10)
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=background_thread)
    thread.start()
    assert started.wait(10)
    cores_now.update(everywhere)  # vLLM bound its OpenMP threads to the other cores
    spread_background_threads()
    release.set()
    thread.join()
    assert seen == [{first}, everywhere]
