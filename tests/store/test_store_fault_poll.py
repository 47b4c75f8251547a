"""Both connector halves poll the store's fault counters on every engine step, decode steps
included (``runtime.Shared.take_store_faults``). ``TieredStore.stats()`` costs about 0.1 ms, so it
is read only when a fault counter moved (``TieredStore.faults_version``): hits, misses and writes
move every request, faults almost never. No fault goes unreported."""

from __future__ import annotations

from orbitkv.connector import runtime
from orbitkv.store.tiered import TieredStore
from store_testing import FP, canonical, canonical_key


def _counting_stats(store: TieredStore) -> list[int]:
    calls = [0]
    stats = store.stats

    def counted() -> dict[str, float]:
        calls[0] += 1
        return stats()

    store.stats = counted  # type: ignore[method-assign]
    return calls


def test_the_fault_version_moves_with_faults_only(tmp_path):
    with TieredStore(memory_nbytes=1 << 20, disk_dir=str(tmp_path), disk_nbytes=1 << 20) as store:
        before = store.faults_version()
        store.stats()  # sets every tier's gauges
        assert store.faults_version() == before
        key = canonical_key(5)
        store.put(key, canonical(5))
        assert store.flush()
        assert store.get([key], expect_fingerprint=FP)[0] is not None  # a hit
        assert store.get([canonical_key(6)]) == [None]  # a miss
        assert store.faults_version() == before
        store.tiers[1].batch_put([(key.to_str(), b"not an entry")])
        store.memory.batch_delete([key.to_str()])
        assert store.get([key], expect_fingerprint=FP) == [None]  # corrupt on disk: a fault
        assert store.faults_version() != before


def test_a_poll_reads_stats_only_after_a_fault_counter_moved_and_reports_every_fault(tmp_path):
    with TieredStore(memory_nbytes=1 << 20, disk_dir=str(tmp_path), disk_nbytes=1 << 20) as store:
        shared = runtime.Shared(store, writer=None)  # the poll never touches the writer
        calls = _counting_stats(store)
        assert not any(shared.take_store_faults().values()) and calls[0] == 1
        for _ in range(5):  # decode steps: nothing read or written
            assert shared.take_store_faults() == {}
        assert calls[0] == 1
        key = canonical_key(3)
        store.put(key, canonical(3))
        # The put's disk write is in the background: landed first, it cannot undo the corruption.
        assert store.flush()
        assert store.get([key], expect_fingerprint=FP)[0] is not None
        assert shared.take_store_faults() == {} and calls[0] == 1  # a write and a hit: no fault
        store.tiers[1].batch_put([(key.to_str(), b"not an entry")])
        store.memory.batch_delete([key.to_str()])
        assert store.get([key], expect_fingerprint=FP) == [None]  # the disk copy is corrupt
        assert shared.take_store_faults()["corrupt_entries"] == 1 and calls[0] == 2
        # The corrupt file's removal may still move a counter: read again, but nothing new.
        assert not any(shared.take_store_faults().values())


def test_counters_added_together_are_counted_and_move_the_fault_version_only_with_a_fault():
    from orbitkv.store import base

    stats = base.Stats()
    before = base.fault_events[0]
    stats.add_many((("hits", 2), ("misses", 1), ("hits", 3)))
    assert (stats.get("hits"), stats.get("misses")) == (5, 1)
    assert base.fault_events[0] == before
    stats.add_many((("hits", 1), ("corrupt.disk", 1)))
    assert stats.get("corrupt.disk") == 1 and base.fault_events[0] == before + 1
    # A name's verdict is remembered, and the same for a name seen before.
    assert base.is_fault("errors.redis") and base.is_fault("errors.redis")
    assert not base.is_fault("hits.memory") and not base.is_fault("hits.memory")
