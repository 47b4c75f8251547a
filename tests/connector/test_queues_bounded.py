"""The save writer and the patch queue are bounded in bytes as well as in jobs: over the byte cap a
save or a patch job is dropped and counted, so gathered KV never piles up behind a slow store."""

from __future__ import annotations

import threading

from orbitkv.connector import runtime
from orbitkv.connector.worker.patch_queue import PatchQueue
from orbitkv.store.tiered import TieredStore


def test_save_writer_drops_saves_over_its_byte_cap():
    store = TieredStore(memory_nbytes=1 << 20)
    writer = runtime.SaveWriter(store, max_queue=1024, max_nbytes=100)
    release, started = threading.Event(), threading.Event()

    def stalled():
        started.set()
        release.wait(5)
        return []

    writer.submit(frozenset({"a"}), stalled, 60)
    assert started.wait(5)
    writer.submit(frozenset({"b"}), list, 30)  # 90 held: fits
    writer.submit(frozenset({"c"}), list, 30)  # 120 would be held: dropped
    assert writer.held_nbytes == 90 and writer.num_dropped == 1
    assert writer.has_pending(["b"]) and not writer.has_pending(["c"])
    release.set()
    writer.flush()
    assert writer.held_nbytes == 0 and writer.peak_nbytes == 90
    # A save larger than the cap alone is still taken when nothing else is held.
    writer.submit(frozenset({"d"}), list, 500)
    writer.flush()
    assert writer.num_dropped == 1
    writer.close()
    store.close()


def test_patch_queue_drops_jobs_over_its_byte_cap():
    store = TieredStore(memory_nbytes=1 << 20)
    patches = PatchQueue(store, idle_s=3600, max_delay_s=3600, max_jobs=256, max_nbytes=100)
    patches.mark_step()  # the engine is busy: nothing is formed until flush
    assert patches.submit(list, 60)
    assert patches.submit(list, 40)
    assert not patches.submit(list, 1)  # 101 bytes held: dropped, counted
    assert patches.num_dropped == 1 and patches.held_nbytes == 100
    patches.flush()
    assert patches.held_nbytes == 0 and patches.peak_nbytes == 100
    assert patches.submit(list, 1)
    patches.close()
    store.close()


def test_dropped_store_writes_are_a_reported_fault(tmp_path):
    # A disk tier too small for the value drops the write, as a full queue would: both are counted
    # in the store's dropped_writes, which the connector reports as a fault kind.
    store = TieredStore(memory_nbytes=1 << 20, disk_dir=str(tmp_path), disk_nbytes=10)
    assert runtime._store_faults(store)["dropped_store_writes"] == 0
    store.put_bytes([("k", b"x" * 100)])
    assert store.flush(5)
    assert runtime._store_faults(store)["dropped_store_writes"] == 1
    store.close()


def test_save_writer_flush_returns_at_its_timeout():
    """A store stalled behind a save does not hold a flush (shutdown) past its timeout: it says the
    save has not landed; once the store answers, a flush waits for it and says it has."""
    import time

    store = TieredStore(memory_nbytes=1 << 20)
    writer = runtime.SaveWriter(store)
    release = threading.Event()

    def stalled():
        release.wait(30)
        return []

    writer.submit(frozenset({"a"}), stalled)
    begin = time.monotonic()
    assert writer.flush(timeout_s=0.3) is False
    assert 0.3 <= time.monotonic() - begin < 5
    assert writer.has_pending(["a"])
    release.set()
    assert writer.flush(timeout_s=None) is True
    assert not writer.has_pending(["a"])
    writer.close()
    store.close()
