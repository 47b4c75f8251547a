"""A disk tier remembers the keys it found absent until any process changes the directory (its
ledger's stamp), so a planner's lookups of many missing keys cost no file-system calls, and an
entry another process wrote is seen at once."""

from __future__ import annotations

import os
import shutil

from orbitkv.store.disk import DiskBackend


def test_absent_keys_are_remembered_until_another_process_writes(tmp_path):
    a = DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    b = DiskBackend(tmp_path, 1 << 20, is_fsync=False)  # another process on the same directory
    try:
        assert a.batch_exists(["okv2:x", "okv2:y"]) == [False, False]
        # A file put there behind the ledger's back (no DiskBackend wrote it) is not looked for:
        # the absent keys are remembered while no write went through the ledger.
        b.batch_put([("okv2:x", b"payload")])
        os.makedirs(os.path.dirname(a.path_of("okv2:y")), exist_ok=True)
        shutil.copy(b.path_of("okv2:x"), a.path_of("okv2:y"))
        assert a.batch_exists(["okv2:x"]) == [True]  # b's write changed the stamp: looked up again
        assert a.batch_exists(["okv2:y"]) == [True]
        b.batch_delete(["okv2:x"])
        assert a.batch_exists(["okv2:x"]) == [False]
        os.unlink(a.path_of("okv2:y"))
        with open(a.path_of("okv2:y"), "wb") as f:  # written behind the ledger again
            f.write(b"p")
        assert a.batch_exists(["okv2:y", "okv2:z"]) == [True, False]
        path = a.path_of("okv2:z")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:  # behind the ledger: z stays remembered absent ...
            f.write(b"p")
        assert a.batch_exists(["okv2:z"]) == [False]
        b.batch_put([("okv2:w", b"w")])  # ... until any write through the ledger
        assert a.batch_exists(["okv2:z", "okv2:w"]) == [True, True]
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
