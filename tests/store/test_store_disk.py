"""Disk tier: atomic files, restart index, LRU budget, safe names, full disk."""

from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest
from orbitkv.store.disk import DiskBackend, filename_to_key, key_to_filename


def _files(root) -> list[str]:
    """Every file in the shards (the root holds only the directory's ledger, budget and lock)."""
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if d != str(root)]


def test_put_get_restart_rebuilds_index(tmp_path):
    disk = DiskBackend(tmp_path, 10_000, is_fsync=False)
    disk.batch_put([("okv1:canonical:" + "a" * 32, b"hello"), ("other/../key", b"x" * 10)])
    assert disk.batch_get(["okv1:canonical:" + "a" * 32, "other/../key", "nope"]) == [
        b"hello", b"x" * 10, None]
    again = DiskBackend(tmp_path, 10_000)
    assert again.used_nbytes == 15
    assert sorted(again.iter_keys()) == sorted(["okv1:canonical:" + "a" * 32, "other/../key"])
    assert again.batch_exists(["other/../key", "nope"]) == [True, False]
    assert all(os.path.dirname(os.path.dirname(p)) == str(tmp_path) for p in _files(tmp_path))


@pytest.mark.parametrize("key", ["..", ".", "a/b", "ümlaut key", "okv1:x:y", "-_AZaz09", "%41"])
def test_filenames_are_safe_and_reversible(key):
    name = key_to_filename(key)
    assert "/" not in name and not name.startswith(".") and name not in ("", "..")
    assert filename_to_key(name) == key


def test_get_view_is_mmapped(tmp_path):
    disk = DiskBackend(tmp_path, 1000)
    disk.batch_put([("k", b"0123456789")])
    view = disk.get_view("k")
    assert bytes(view[2:5]) == b"234"
    view.close()
    assert disk.get_view("missing") is None


def test_budget_soak_and_lru(tmp_path):
    budget = 200_000
    disk = DiskBackend(tmp_path, budget, is_fsync=False)
    for i in range(120):
        disk.batch_put([(f"k{i}", os.urandom(5_000 + (i % 7) * 100))])
        disk.batch_get(["k0"])  # keep k0 hot
    on_disk = sum(os.path.getsize(p) for p in _files(tmp_path))
    assert 0.95 * budget <= on_disk <= budget
    assert disk.used_nbytes == on_disk
    assert disk.batch_exists(["k0", "k1", "k119"]) == [True, False, True]
    assert disk.stats()["evictions"] > 0


def test_stale_tmp_files_removed_on_start(tmp_path):
    shard = tmp_path / "ab"
    shard.mkdir()
    stale = shard / ".tmp-1-2-3"
    stale.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    disk = DiskBackend(tmp_path, 1000)
    assert not stale.exists() and list(disk.iter_keys()) == []


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs when mounting is allowed, else None (the test then fakes ENOSPC)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                         capture_output=True)
    if res.returncode != 0:
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_drops_writes_and_reads_go_on(tiny_fs, tmp_path, monkeypatch):
    root = tiny_fs or tmp_path / "fake"
    disk = DiskBackend(root, 64 << 20)  # budget far above the filesystem's size
    disk.batch_put([("first", b"x" * 1000)])
    if tiny_fs is None:
        real_write = os.write

        def full(fd, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "write", full)
    for i in range(8):
        disk.batch_put([(f"big{i}", os.urandom(300_000))])
    if tiny_fs is None:
        monkeypatch.setattr(os, "write", real_write)
    s = disk.stats()
    assert s["dropped_writes"] >= 5 and s["enospc"] >= 5
    assert disk.batch_get(["first"]) == [b"x" * 1000]
    assert not any(os.path.basename(p).startswith(".tmp") for p in _files(root))
    # Every file that is there is whole, and usage accounting matches the files.
    assert disk.used_nbytes == sum(os.path.getsize(p) for p in _files(root))
