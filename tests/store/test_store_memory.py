"""Memory tier: budget, LRU, pins, thread safety."""

from __future__ import annotations

import threading

from orbitkv.store.memory import MemoryBackend


def test_lru_eviction_within_budget():
    mem = MemoryBackend(1000)
    for i in range(5):
        mem.batch_put([(f"k{i}", bytes(300))])
        if i == 2:
            mem.batch_get(["k0"])  # k0 becomes the most recent
    assert mem.used_nbytes <= 1000
    assert mem.batch_exists(["k0", "k1", "k2", "k3", "k4"]) == [True, False, False, True, True]
    assert mem.stats()["evictions"] == 2


def test_pins_protect_from_eviction_and_count():
    mem = MemoryBackend(1000)
    mem.batch_put([("a", bytes(400)), ("b", bytes(400))])
    mem.pin(["a", "a"])
    assert mem.pin_count("a") == 2
    mem.batch_put([("c", bytes(400))])
    assert mem.batch_exists(["a", "b", "c"]) == [True, False, True]
    mem.pin(["c"])
    mem.batch_put([("d", bytes(400))])  # everything else is pinned: the write is dropped
    assert mem.batch_exists(["a", "c", "d"]) == [True, True, False]
    assert mem.stats()["dropped_writes"] == 1
    mem.unpin(["a"])
    assert mem.pin_count("a") == 1
    mem.unpin(["a", "a", "c"])
    assert mem.pin_count("a") == 0 and mem.pin_count("c") == 0
    mem.batch_put([("d", bytes(400))])
    assert mem.batch_exists(["d"]) == [True]


def test_oversized_write_dropped_and_delete():
    mem = MemoryBackend(100)
    mem.batch_put([("big", bytes(101)), ("x", b"1")])
    assert mem.batch_get(["big", "x"]) == [None, b"1"]
    mem.batch_delete(["x", "missing"])
    assert mem.used_nbytes == 0 and list(mem.iter_keys()) == []


def test_thread_safe_budget_soak():
    mem = MemoryBackend(50_000)

    def work(t: int) -> None:
        for i in range(400):
            mem.batch_put([(f"{t}-{i}", bytes(100 + i % 50))])
            mem.batch_get([f"{t}-{i - 3}"])

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mem.used_nbytes <= 50_000
    assert mem.used_nbytes == sum(len(v) for v in mem.batch_get(list(mem.iter_keys())))
    assert mem.used_nbytes >= 0.95 * 50_000
