"""The low-priority patch queue: nothing is formed while the engine keeps stepping, a job runs once
the engine idles or once it waited its longest, ``flush`` forms everything, a full queue drops."""

from __future__ import annotations

import threading
import time

from orbitkv.connector.worker.patch_queue import PatchQueue
from orbitkv.store.tiered import TieredStore


def _job(done: list[float]):
    def job():
        done.append(time.monotonic())
        return []

    return job


def _busy(queue: PatchQueue, seconds: float) -> None:
    """An engine stepping back to back for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        queue.mark_step()
        time.sleep(0.005)


def test_a_patch_waits_for_the_engine_to_idle():
    with TieredStore(memory_nbytes=1 << 20) as store:
        queue = PatchQueue(store, idle_s=0.05, max_delay_s=60.0)
        try:
            done: list[float] = []
            queue.mark_step()
            queue.submit(_job(done))
            _busy(queue, 0.4)
            assert done == []  # never during back-to-back steps
            idle_from = time.monotonic()
            deadline = idle_from + 5.0
            while not done and time.monotonic() < deadline:
                time.sleep(0.01)
            assert done and done[0] - idle_from >= 0.04
        finally:
            queue.close()


def test_a_patch_is_formed_after_its_longest_wait_on_an_engine_that_never_idles():
    with TieredStore(memory_nbytes=1 << 20) as store:
        queue = PatchQueue(store, idle_s=10.0, max_delay_s=0.2)
        try:
            done: list[float] = []
            stepping = threading.Thread(target=_busy, args=(queue, 1.0))
            stepping.start()
            time.sleep(0.05)
            submitted = time.monotonic()
            queue.submit(_job(done))
            stepping.join()
            assert len(done) == 1 and done[0] - submitted >= 0.19
        finally:
            queue.close()


def test_flush_forms_now_and_a_full_queue_drops():
    with TieredStore(memory_nbytes=1 << 20) as store:
        queue = PatchQueue(store, idle_s=60.0, max_delay_s=60.0, max_jobs=2)
        try:
            done: list[float] = []
            queue.mark_step()
            for _ in range(3):
                queue.submit(_job(done))
            assert queue.num_dropped == 1 and queue.num_pending == 2
            queue.flush()
            assert len(done) == 2 and queue.num_pending == 0
        finally:
            queue.close()
