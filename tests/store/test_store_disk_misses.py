"""A disk tier knows its directory's files without a stat per lookup: its last scan plus the files
journaled since (``<root>/.written``), which every ``DiskBackend`` write appends to before the
ledger's stamp changes; when the journal cannot tell, it stats and remembers the misses
(``store/disk_view.py``)."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
from orbitkv.store import disk as disk_module
from orbitkv.store import disk_files, disk_ledger
from orbitkv.store.disk import DiskBackend


@pytest.fixture
def stats(monkeypatch):
    """The entry files looked for with ``os.path.exists`` (``batch_exists``'s stat)."""
    seen: list[str] = []
    real_exists = os.path.exists

    def exists(path):
        if os.path.basename(path).startswith("okv2"):
            seen.append(path)
        return real_exists(path)

    monkeypatch.setattr(disk_module.os.path, "exists", exists)
    return seen


def _behind_the_ledger(a, src_key, key):
    """Put ``key``'s file in place without a DiskBackend (no journal, no stamp change)."""
    os.makedirs(os.path.dirname(a.path_of(key)), exist_ok=True)
    shutil.copy(a.path_of(src_key), a.path_of(key))


def test_absent_keys_cost_no_stat_and_another_process_write_is_seen(tmp_path, stats):
    a = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    b = DiskBackend(tmp_path, 1 << 20, is_fsync=False)  # another process on the same directory
    try:
        assert a.batch_exists(["okv2:x", "okv2:y", "okv2:z"]) == [False, False, False]
        b.batch_put([("okv2:x", b"payload")])
        assert a.batch_exists(["okv2:x", "okv2:y", "okv2:z"]) == [True, False, False]
        assert stats == []
        # Put there behind the ledger: not seen until a scan (a new process scans at start).
        _behind_the_ledger(a, "okv2:x", "okv2:y")
        assert a.batch_exists(["okv2:y"]) == [False]
        c = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
        try:
            assert c.batch_exists(["okv2:x", "okv2:y", "okv2:z"]) == [True, True, False]
            # Removed behind the ledger: "present" until a read misses it, then absent.
            os.unlink(c.path_of("okv2:y"))
            assert c.batch_exists(["okv2:y"]) == [True]
            assert c.batch_get(["okv2:y"]) == [None]
            assert c.batch_exists(["okv2:y"]) == [False]
        finally:
            c.close()
        # Another process's delete (or eviction) is journaled too.
        b.batch_delete(["okv2:x"])
        assert a.batch_exists(["okv2:x"]) == [False]
        b.batch_put([("okv2:x", b"again")])
        assert a.batch_exists(["okv2:x"]) == [True]
        assert stats == []
    finally:
        a.close()
        b.close()


def test_an_emptied_journal_means_stats_again_with_misses_remembered(tmp_path, monkeypatch, stats):
    monkeypatch.setattr(disk_ledger, "MAX_WRITTEN_NBYTES", 64)
    a = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    b = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    try:
        b.batch_put([("okv2:x", b"x")])
        _behind_the_ledger(a, "okv2:x", "okv2:y")
        b.batch_put([(f"okv2:w{i}", b"w") for i in range(8)])  # past 64 bytes: emptied, epoch + 1
        assert os.path.getsize(tmp_path / disk_ledger.WRITTEN_NAME) <= 64 + 32
        assert a.batch_exists(["okv2:y", "okv2:z", "okv2:w7"]) == [True, False, True]
        assert sorted(stats) == sorted(a.path_of(k) for k in ("okv2:y", "okv2:z", "okv2:w7"))
        stats.clear()
        assert a.batch_exists(["okv2:z"]) == [False]  # remembered
        b.batch_put([("okv2:z", b"z")])  # journaled: forgotten as a miss, known present
        assert a.batch_exists(["okv2:z"]) == [True]
        assert stats == []
    finally:
        a.close()
        b.close()


def test_a_lookup_between_a_reservation_and_the_file_sees_the_file_once_journaled(tmp_path):
    """The order the journal relies on: b reserves (stamp changes, no file yet), a looks up; b's
    file lands, then is journaled: a's next lookup finds it."""
    a = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    b = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    try:
        assert a.batch_exists(["okv2:k"]) == [False]
        assert b._reserve("okv2:k", 3) == 3
        assert a.batch_exists(["okv2:k"]) == [False]
        disk_files.write_atomic(b.path_of("okv2:k"), b"abc", "test", is_fsync=False)
        assert a.batch_exists(["okv2:k"]) == [False]  # in place, not yet journaled
        b._ledger.bump_written(os.path.basename(b.path_of("okv2:k")))
        assert a.batch_exists(["okv2:k"]) == [True]
    finally:
        a.close()
        b.close()


def test_the_ledger_keeps_its_used_bytes_beside_the_generation(tmp_path):
    a = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    try:
        a.batch_put([("okv2:k1", b"x" * 100), ("okv2:k2", b"y" * 50)])
        before = a._ledger.stamp()
        with a._ledger.locked():
            assert a._ledger.read_used() == 150
        a.batch_delete(["okv2:k1"])
        with a._ledger.locked():
            assert a._ledger.read_used() == 50
        assert a._ledger.stamp() != before
    finally:
        a.close()


def test_own_writes_move_the_view_on_the_writing_thread_so_a_lookup_reads_no_journal(
    tmp_path, monkeypatch
):
    """A lookup runs on the scheduler's path: after this process's own puts and deletes it reads
    the stamp alone; another process's write still makes it read the journal."""
    a = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    b = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    reads: list[tuple[int, int]] = []
    real = disk_ledger.DirectoryLedger.written_since

    def counted(self, epoch, offset):
        reads.append((epoch, offset))
        return real(self, epoch, offset)

    monkeypatch.setattr(disk_ledger.DirectoryLedger, "written_since", counted)
    try:
        a.batch_put([("okv2:k1", b"x" * 10), ("okv2:k2", b"y" * 10)])
        a.batch_delete(["okv2:k1"])
        assert a.batch_exists(["okv2:k1", "okv2:k2", "okv2:k3"]) == [False, True, False]
        assert reads == []
        b.batch_put([("okv2:k3", b"z")])
        assert a.batch_exists(["okv2:k3"]) == [True]
        assert len(reads) == 1
        # Caught up with b's line, then its own write again: no read.
        a.batch_put([("okv2:k4", b"w")])
        assert a.batch_exists(["okv2:k3", "okv2:k4", "okv2:k5"]) == [True, True, False]
        assert len(reads) == 1
    finally:
        a.close()
        b.close()


def test_a_scan_and_a_lookup_catching_up_do_not_deadlock(tmp_path, monkeypatch):
    """A scan starts the view under the ledger's lock; a lookup catching up takes the ledger's
    lock to read the journal. The lookup must not hold the view's lock while it waits."""
    a = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    b = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    b.batch_put([("okv2:k", b"x")])  # a's stamp is stale: its next lookup catches up
    waiting = threading.Event()
    real_locked = disk_ledger.DirectoryLedger.locked

    def locked(self):
        if threading.current_thread().name == "lookup":
            waiting.set()
        return real_locked(self)

    monkeypatch.setattr(disk_ledger.DirectoryLedger, "locked", locked)
    found: list[list[bool]] = []
    lookup = threading.Thread(
        target=lambda: found.append(a.batch_exists(["okv2:k"])), name="lookup", daemon=True
    )
    try:
        with a._ledger.locked():
            lookup.start()
            assert waiting.wait(10), "the lookup never asked for the ledger's lock"
            scan = threading.Thread(target=a._rescan, daemon=True)
            scan.start()
            scan.join(10)
            assert not scan.is_alive(), "the scan waits on the view held by the lookup: deadlock"
        lookup.join(10)
        assert found == [[True]]
    finally:
        a.close()
        b.close()


def test_a_follower_reads_another_process_writes_before_the_lookup_does(tmp_path, monkeypatch):
    """A scheduler whose worker writes from another process follows the journal on a thread: a
    lookup after the follower caught up reads the stamp alone and still sees the write."""
    a = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    b = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    callers: list[str] = []
    real = disk_ledger.DirectoryLedger.written_since

    def counted(self, epoch, offset):
        callers.append(threading.current_thread().name)
        return real(self, epoch, offset)

    monkeypatch.setattr(disk_ledger.DirectoryLedger, "written_since", counted)
    try:
        a.follow_other_writers(interval_s=0.001)
        a.follow_other_writers(interval_s=0.001)  # idempotent: one thread
        b.batch_put([("okv2:k", b"x")])
        deadline = time.monotonic() + 10
        while a._view._stamp != a._ledger.stamp() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert callers and set(callers) == {"orbitkv-disk-follower"}
        assert a.batch_exists(["okv2:k", "okv2:other"]) == [True, False]
        assert threading.current_thread().name not in callers
        followers = [t for t in threading.enumerate() if t.name == "orbitkv-disk-follower"]
        assert len(followers) == 1
        # A background thread: at a lower priority than the threads that run the engine.
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert os.getpriority(os.PRIO_PROCESS, followers[0].native_id) > own or own >= 19
    finally:
        a.close()
        b.close()
    assert "orbitkv-disk-follower" not in [t.name for t in threading.enumerate()]
