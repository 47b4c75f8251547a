"""A step's saves copied out of the cache between steps (``worker/saving.py``): once vLLM has run
``handle_preemptions`` (its barrier before a step writes the cache), ``wait_for_save`` starts the
copy on its own thread and returns; the next step's barrier waits for it, so a write to the same
slots after the barrier (a finished request's blocks given to another) never reaches the entry."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from halves_testlib import kv, step_meta
from orbitkv.connector.worker import saving

SYS, C1, Q = [1] * 4, [2] * 4, [9, 9]
COPY_DELAY_S = 0.3


def _computing_step(sched, caches, seed):
    """A first request computed whole in one step (nothing to load): its step's metadata."""
    return step_meta(sched, caches, "a", SYS + C1 + Q, [1, 2, 3], seed)


def _forward(worker, caches, meta):
    worker.start_load_kv(meta)
    for name in caches:
        worker.wait_for_layer_load(name)


def _slow_copies(monkeypatch):
    """The copy starts only after ``COPY_DELAY_S``: a barrier that did not wait would let the
    test's overwrite reach the cache first. Records the thread and OpenMP threads of each copy."""
    calls = []
    real = saving.gather_stacked

    def slow(*args, **kwargs):
        calls.append((threading.current_thread().name, kwargs.get("num_threads")))
        time.sleep(COPY_DELAY_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(saving, "gather_stacked", slow)
    return calls


@pytest.mark.parametrize("is_native", [True, False])
def test_the_copy_runs_between_steps_and_the_barrier_waits_for_it(halves, monkeypatch, is_native):
    from orbitkv.kernels import paged_native

    monkeypatch.setattr(paged_native, "is_enabled", is_native)
    sched, worker, caches, shared = halves
    calls = _slow_copies(monkeypatch)
    worker.before_step()  # vLLM shows it runs the barrier: copies may leave the forward's path
    meta = _computing_step(sched, caches, seed=4)
    expected = kv(caches, [1, 2, 3], 0, 10)
    _forward(worker, caches, meta)
    started = time.perf_counter()
    worker.wait_for_save(meta)
    assert time.perf_counter() - started < COPY_DELAY_S  # the forward did not wait for the copy
    started = time.perf_counter()
    worker.before_step()  # the next step's barrier
    assert time.perf_counter() - started >= COPY_DELAY_S / 2
    # The next step writes the same slots (the blocks went to another request).
    for cache in caches.values():
        cache.zero_()
    shared.writer.flush()
    assert calls == [("orbitkv-save-copy_0", 1)]
    seconds = worker._seconds.take()
    assert seconds["seconds.save_wait"] >= COPY_DELAY_S / 2
    assert seconds["seconds.save_copy"] >= COPY_DELAY_S
    assert "seconds.save_gather" not in seconds
    for spec in meta.saves:
        (entry,) = shared.store.get([spec.keys["conditioned"]])
        assert entry is not None
        for li, (k, v) in enumerate(expected):
            assert torch.equal(entry.tensors[f"k.{li}"], k[spec.start : spec.end])
            assert torch.equal(entry.tensors[f"v.{li}"], v[spec.start : spec.end])


def test_without_the_barrier_the_copy_stays_on_the_forwards_path(halves, monkeypatch):
    """A runner that never calls ``handle_preemptions`` gets its saves copied before
    ``wait_for_save`` returns: nothing else would keep the slots from being rewritten."""
    sched, worker, caches, shared = halves
    calls = _slow_copies(monkeypatch)
    meta = _computing_step(sched, caches, seed=5)
    expected = kv(caches, [1, 2, 3], 0, 10)
    _forward(worker, caches, meta)
    started = time.perf_counter()
    worker.wait_for_save(meta)
    assert time.perf_counter() - started >= COPY_DELAY_S
    assert calls == [(threading.current_thread().name, None)]
    for cache in caches.values():
        cache.zero_()
    shared.writer.flush()
    assert worker._seconds.take()["seconds.save_gather"] >= COPY_DELAY_S
    (entry,) = shared.store.get([meta.saves[0].keys["conditioned"]])
    spec = meta.saves[0]
    assert torch.equal(entry.tensors["k.0"], expected[0][0][spec.start : spec.end])


def test_a_failed_copy_fails_its_saves_not_the_step(halves, monkeypatch):
    sched, worker, caches, shared = halves

    def broken(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(saving, "gather_stacked", broken)
    worker.before_step()
    meta = _computing_step(sched, caches, seed=6)
    _forward(worker, caches, meta)
    worker.wait_for_save(meta)
    worker.before_step()
    shared.writer.flush()
    assert shared.writer.num_failed == len(meta.saves) > 0
    keys = [k for s in meta.saves for k in s.keys.values()]
    assert shared.store.get(keys) == [None] * len(keys)
