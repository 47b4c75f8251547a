"""Local-disk tier: one file per entry under a directory, with a byte budget and LRU eviction.

- Writes are atomic: a private temp file, fsync, then ``os.replace``. A reader (this process or another
  one sharing the directory) sees either no file or the whole file, never a torn one.
- The LRU index lives in memory and is rebuilt from the directory on start (ordered by the files'
  access/modify times; reads bump both with ``os.utime`` so recency survives a restart).
- Any ``OSError`` on a write (``ENOSPC`` included) drops that write and counts it; reads carry on.
- Reads go through ``mmap``; ``get_view`` hands out the mapping itself so a caller can decode only
  some layers of a large entry.
- Filenames are the key with every byte outside ``[A-Za-z0-9_-]`` written as ``%XX``: reversible,
  never hidden (temp files start with ``.``), never ``..``, never a path separator. Keys are hashes,
  so no prompt text reaches the filesystem.

Calls are synchronous; the tiered store runs them on its background writer threads.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from urllib.parse import unquote_to_bytes

import xxhash

from . import base
from .base import Backend

_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_NAME_NBYTES = 240
STALE_TMP_AGE_S = 300.0


def key_to_filename(key: str) -> str:
    return "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in key)


def filename_to_key(name: str) -> str:
    return unquote_to_bytes(name).decode("utf-8")


class DiskBackend(Backend):
    name = "disk"

    def __init__(self, root: str | os.PathLike, budget_nbytes: int, *, is_fsync: bool = True) -> None:
        super().__init__()
        self.root = os.fspath(root)
        self.budget_nbytes = int(budget_nbytes)
        self.is_fsync = is_fsync
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> nbytes, least recent first
        self._used_nbytes = 0
        self._tmp_ids = itertools.count()
        os.makedirs(self.root, exist_ok=True)
        self._rebuild_index()

    # -- paths -------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        shard = xxhash.xxh3_64_hexdigest(key.encode())[:2]
        return os.path.join(self.root, shard, key_to_filename(key))

    def _rebuild_index(self) -> None:
        found = []
        now = time.time()
        for shard in os.scandir(self.root):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for item in os.scandir(shard.path):
                try:
                    st = item.stat(follow_symlinks=False)
                    if item.name.startswith("."):
                        # A writer that died between create and rename; live writers are younger.
                        if now - st.st_mtime > STALE_TMP_AGE_S:
                            os.unlink(item.path)
                        continue
                    key = filename_to_key(item.name)
                except (OSError, UnicodeDecodeError, ValueError):
                    continue
                found.append((max(st.st_atime, st.st_mtime), key, st.st_size))
        found.sort()
        with self._lock:
            self._index = OrderedDict((key, size) for _, key, size in found)
            self._used_nbytes = sum(size for _, _, size in found)

    @property
    def used_nbytes(self) -> int:
        return self._used_nbytes

    # -- reads -------------------------------------------------------------------------------

    def _touch(self, key: str, nbytes: int) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            else:  # written by another process sharing the directory
                self._index[key] = nbytes
                self._used_nbytes += nbytes

    def _forget(self, key: str) -> None:
        with self._lock:
            nbytes = self._index.pop(key, None)
            if nbytes is not None:
                self._used_nbytes -= nbytes

    def get_view(self, key: str) -> mmap.mmap | None:
        """The entry's file mapped read-only (decode it with ``layers=``), or None on a miss."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    self._forget(key)
                    return None
                view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            self._forget(key)
            return None
        except (OSError, ValueError):
            self.counters.add(base.ERRORS)
            return None
        self._touch(key, size)
        try:
            os.utime(path)
        except OSError:
            pass  # recency across restarts is best effort
        return view

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        base.check_keys(keys)
        values: list[bytes | None] = []
        for key in keys:
            view = self.get_view(key)
            if view is None:
                values.append(None)
                continue
            with view:
                values.append(bytes(view))
        self.count_reads(values)
        return values

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        base.check_keys(keys)
        with self._lock:
            known = [k in self._index for k in keys]
        return [is_known or os.path.exists(self._path(k)) for k, is_known in zip(keys, known, strict=True)]

    # -- writes ------------------------------------------------------------------------------

    def _reserve(self, key: str, nbytes: int) -> list[str] | None:
        """Account for a write and pick LRU victims; None if the entry can never fit."""
        if nbytes > self.budget_nbytes:
            return None
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None:
                self._used_nbytes -= old
            victims = []
            while self._used_nbytes + nbytes > self.budget_nbytes and self._index:
                victim, size = self._index.popitem(last=False)
                self._used_nbytes -= size
                victims.append(victim)
            self._index[key] = nbytes
            self._used_nbytes += nbytes
        return victims

    def _unlink(self, keys: Sequence[str]) -> int:
        num_removed = 0
        for key in keys:
            try:
                os.unlink(self._path(key))
                num_removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                self.counters.add(base.ERRORS)
        return num_removed

    def _write_file(self, path: str, value: bytes) -> None:
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f".tmp-{os.getpid()}-{threading.get_ident()}-{next(self._tmp_ids)}")
        os.makedirs(directory, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(value)
            while view:
                view = view[os.write(fd, view) :]
            if self.is_fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def batch_put(self, items: Sequence[tuple[str, bytes]]) -> None:
        base.check_keys([k for k, _ in items])
        for key, value in items:
            path = self._path(key)
            victims = None
            if len(os.path.basename(path).encode()) <= MAX_NAME_NBYTES:
                victims = self._reserve(key, len(value))
            if victims is None:
                self.counters.add(base.DROPPED_WRITES)
                continue
            self.counters.add(base.EVICTIONS, self._unlink(victims))
            try:
                self._write_file(path, value)
            except OSError as exc:
                self._forget(key)
                self.counters.add(base.DROPPED_WRITES)
                self.counters.add(base.ERRORS)
                if exc.errno == errno.ENOSPC:
                    self.counters.add("enospc")
                continue
            self.counters.add(base.WRITES)
            self.counters.add(base.WRITTEN_NBYTES, len(value))

    def batch_delete(self, keys: Sequence[str]) -> None:
        base.check_keys(keys)
        for key in keys:
            self._forget(key)
        self.counters.add(base.DELETES, self._unlink(keys))

    def iter_keys(self) -> Iterator[str]:
        """Every entry in the directory, including those other processes wrote."""
        try:
            shards = [s.path for s in os.scandir(self.root) if s.is_dir(follow_symlinks=False)]
        except OSError:
            self.counters.add(base.ERRORS)
            return
        for shard in shards:
            try:
                names = [e.name for e in os.scandir(shard)]
            except OSError:
                continue
            for name in names:
                if not name.startswith("."):
                    try:
                        yield filename_to_key(name)
                    except (UnicodeDecodeError, ValueError):
                        continue

    def stats(self) -> dict[str, float]:
        with self._lock:
            self.counters.set_gauge(base.USED_NBYTES, self._used_nbytes)
            self.counters.set_gauge(base.NUM_ENTRIES, len(self._index))
        self.counters.set_gauge(base.BUDGET_NBYTES, self.budget_nbytes)
        return super().stats()
