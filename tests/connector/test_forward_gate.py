"""The writer builds a save between two forwards (``connector/forward_gate.py``): a job submitted
while the worker's step runs waits for its end, at most ``max_hold_s``; a flush never waits for the
engine."""

from __future__ import annotations

import threading
import time

import pytest
from orbitkv.connector import runtime
from orbitkv.connector.forward_gate import ForwardGate
from orbitkv.store.tiered import TieredStore


def test_a_job_waits_for_the_forward_to_end():
    gate = ForwardGate(max_hold_s=10.0)
    assert gate.wait_for_gap(time.perf_counter()) == 0.0 and gate.num_held == 0  # open: no wait
    gate.begin_forward()
    done = threading.Event()
    waited: list[float] = []
    thread = threading.Thread(target=lambda: (waited.append(gate.wait_for_gap(time.perf_counter())),
                                              done.set()))
    thread.start()
    assert not done.wait(0.1)  # still in the forward
    gate.end_forward()
    assert done.wait(5)
    thread.join()
    assert waited[0] >= 0.1 and gate.num_held == 1 and gate.num_forced == 0
    assert gate.held_s == pytest.approx(waited[0])


def test_a_job_waits_at_most_max_hold_s_counted_as_forced():
    gate = ForwardGate(max_hold_s=0.05)
    gate.begin_forward()  # a forward that never ends (an engine with no gap between steps)
    started = time.perf_counter()
    waited = gate.wait_for_gap(started)
    assert 0.04 <= waited < 2.0 and gate.num_forced == 1
    # The bound runs from the job's submission: a job already that old does not wait at all.
    assert gate.wait_for_gap(time.perf_counter() - 1.0) < 0.04 and gate.num_forced == 2


def test_no_hold_when_disabled_or_bypassed():
    gate = ForwardGate(max_hold_s=0)
    gate.begin_forward()
    assert gate.wait_for_gap(time.perf_counter()) == 0.0 and gate.num_held == 0
    gate = ForwardGate(max_hold_s=10.0)
    gate.begin_forward()
    with gate.bypassed():
        assert gate.wait_for_gap(time.perf_counter()) == 0.0
    with pytest.raises(ValueError, match="max_hold_s"):
        ForwardGate(max_hold_s=-1)


def test_bypass_releases_a_job_already_waiting():
    gate = ForwardGate(max_hold_s=10.0)
    gate.begin_forward()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (gate.wait_for_gap(time.perf_counter()), done.set()))
    thread.start()
    assert not done.wait(0.05)
    with gate.bypassed():
        assert done.wait(5)
    thread.join()
    assert gate.num_forced == 0


def test_the_writer_stores_a_save_made_during_a_forward_after_it_and_flush_does_not_wait():
    store = TieredStore(memory_nbytes=1 << 20)
    writer = runtime.SaveWriter(store, max_hold_s=10.0)
    ran = threading.Event()
    writer.begin_forward()
    writer.submit(frozenset({"a"}), lambda: (ran.set(), [])[1], 10)
    # Not even handed to the thread during the forward (no wake-up there): at its end.
    assert writer.num_deferred == 1
    assert not ran.wait(0.1) and writer.has_pending(["a"])
    writer.end_forward()
    assert writer.num_deferred == 0
    assert ran.wait(5)
    assert writer.flush(5) and not writer.has_pending(["a"])
    # A flush inside a forward (shutdown, a test) runs what is queued now.
    writer.begin_forward()
    ran.clear()
    writer.submit(frozenset({"b"}), lambda: (ran.set(), [])[1], 10)
    started = time.monotonic()
    assert writer.flush(5) and ran.is_set() and time.monotonic() - started < 5
    writer.end_forward()
    # A step that never ends its forward (vLLM's encoder-only step) holds its jobs until the next
    # step starts, then for at most max_hold_s.
    brief = runtime.SaveWriter(store, max_hold_s=0.2)
    brief.begin_forward()
    ran.clear()
    brief.submit(frozenset({"d"}), lambda: (ran.set(), [])[1], 10)
    brief.begin_forward()
    assert brief.num_deferred == 0 and ran.wait(5) and brief.gate.num_forced == 1
    brief.end_forward()
    brief.close()
    # With holding off, a job goes to the thread at once, forward or not.
    unheld = runtime.SaveWriter(store, max_hold_s=0)
    unheld.begin_forward()
    ran.clear()
    unheld.submit(frozenset({"c"}), lambda: (ran.set(), [])[1], 10)
    assert unheld.num_deferred == 0 and ran.wait(5)
    unheld.end_forward()
    unheld.close()
    writer.close()
    store.close()
