"""The disk budget holds for the directory: two stores (two replicas) sharing one directory hold at
most the budget between them, evicting each other's least recently used entries; and ``orbitkv
store gc`` with no budget given uses the one the directory records, or refuses."""

from __future__ import annotations

import json
import multiprocessing
import os

from orbitkv.store import cli as store_cli
from orbitkv.store.disk import DiskBackend, recorded_budget
from store_testing import disk_budget_worker

BUDGET = 20_000
VALUE_NBYTES = 1_000


def _on_disk(root) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
               if d != str(root))


def test_two_stores_on_one_directory_hold_one_budget(tmp_path):
    a = DiskBackend(tmp_path, BUDGET, is_fsync=False)
    b = DiskBackend(tmp_path, BUDGET, is_fsync=False)
    for i in range(30):  # each alone would stay within budget; together 60,000 bytes
        a.batch_put([(f"a{i}", os.urandom(VALUE_NBYTES))])
        b.batch_put([(f"b{i}", os.urandom(VALUE_NBYTES))])
        assert _on_disk(tmp_path) <= BUDGET
    assert a.used_nbytes == b.used_nbytes == _on_disk(tmp_path)
    assert _on_disk(tmp_path) >= BUDGET - 2 * VALUE_NBYTES
    # The newest entries of both survive; the oldest of both were evicted.
    assert a.batch_exists(["a29", "b29", "a0", "b0"]) == [True, True, False, False]
    assert a.stats()["evictions"] + b.stats()["evictions"] == 60 - _on_disk(tmp_path) // VALUE_NBYTES
    a.close()
    b.close()


def test_a_third_store_sees_the_shared_usage(tmp_path):
    a = DiskBackend(tmp_path, BUDGET, is_fsync=False)
    a.batch_put([(f"a{i}", os.urandom(VALUE_NBYTES)) for i in range(15)])
    b = DiskBackend(tmp_path, BUDGET, is_fsync=False)  # a replica restarts, or starts later
    b.batch_put([(f"b{i}", os.urandom(VALUE_NBYTES)) for i in range(15)])
    a.batch_put([("a-late", os.urandom(VALUE_NBYTES))])
    assert _on_disk(tmp_path) <= BUDGET
    assert a.used_nbytes == _on_disk(tmp_path)
    b.batch_delete(["b14"])
    assert a.used_nbytes == _on_disk(tmp_path)
    a.close()
    b.close()


def test_two_processes_on_one_directory_hold_one_budget(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as workers, ctx.Manager() as manager:
        barrier = manager.Barrier(2)
        results = workers.starmap(
            disk_budget_worker,
            [(str(tmp_path), w, 60, BUDGET, VALUE_NBYTES, barrier) for w in range(2)],
        )
    assert [r["writes"] for r in results] == [60, 60]
    assert all(r["errors"] == 0 for r in results)
    # Within budget, give or take the one write the other process had reserved but not yet
    # written when this one rescanned the directory (a rescan counts the files that are there).
    assert _on_disk(tmp_path) <= BUDGET + VALUE_NBYTES
    assert sum(r["evictions"] for r in results) >= 120 - (BUDGET + VALUE_NBYTES) // VALUE_NBYTES


def _gc(capsys, *args):
    rc = store_cli.main(["gc", "--json", *args])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else out.err)


def test_gc_without_a_budget_uses_the_recorded_one_or_refuses(tmp_path, capsys, monkeypatch):
    for name in ("ORBITKV_CONFIG_FILE", "LMCACHE_CONFIG_FILE", "ORBITKV_LOCAL_DISK",
                 "ORBITKV_MAX_LOCAL_DISK_SIZE", "ORBITKV_REMOTE_URL"):
        monkeypatch.delenv(name, raising=False)
    bare = tmp_path / "bare"
    writer = DiskBackend(bare, 10 * BUDGET, is_fsync=False)
    writer.batch_put([(f"k{i}", os.urandom(VALUE_NBYTES)) for i in range(50)])
    writer.close()
    os.remove(bare / ".budget")  # a directory no store recorded a budget in (an older version's)
    rc, err = _gc(capsys, "--disk", str(bare))
    assert rc == 2 and "--budget-gb" in err
    assert _on_disk(bare) == 50 * VALUE_NBYTES  # nothing deleted

    served = tmp_path / "served"
    store = DiskBackend(served, 30 * VALUE_NBYTES, is_fsync=False)
    store.batch_put([(f"k{i}", os.urandom(VALUE_NBYTES)) for i in range(30)])
    store.close()
    DiskBackend(served, 10 * VALUE_NBYTES).close()  # restarted with a lower budget: recorded
    assert recorded_budget(served) == 10 * VALUE_NBYTES
    rc, doc = _gc(capsys, "--disk", str(served))
    assert rc == 0 and doc["tiers"]["disk"]["budget_nbytes"] == 10 * VALUE_NBYTES
    assert _on_disk(served) <= 10 * VALUE_NBYTES
    assert recorded_budget(served) == 10 * VALUE_NBYTES  # gc itself records nothing
