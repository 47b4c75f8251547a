"""What a disk-tier lookup may conclude without a stat: the directory's files as the last scan saw
them plus every file journaled since, or, when the journal cannot tell, remembered misses.

A planner looks up every chunk of every prompt, most of them absent (new chunks); a stat per key
per planning step cost about 40% of ``plan``. Another process sharing the directory (vLLM's worker,
whose writer stores the entries, is another process than its scheduler) may write any key at any
time. Every ``DiskBackend`` write journals the file's name in ``<root>/.written``
(``DirectoryLedger.bump_written``) after the file is in place and before the ledger's stamp
changes, all under the ledger's lock; every removal (an eviction, a delete) journals ``-name``
under the same lock. So:

- ``start`` (called under the ledger's lock, just before a directory scan): the journal position.
  The scan and every name journaled after that position are then every file written through a
  ``DiskBackend``, and a key in neither is absent: no stat.
- on a stamp change the journal is read from the last position; its names are present. This
  process's own writes and removals move the view at once, under the ledger's lock, on the
  writing thread (``follow_locked``), so the next lookup, on the scheduler's path, reads the
  stamp alone. Lock order: the ledger's, then the view's; a lookup reads the journal holding
  neither the view's lock.
- when the journal cannot tell (emptied since, unreadable, or more names than remembered), lookups
  stat again, and remember the keys they found absent until a journaled write names them, or,
  if the journal still cannot tell, until the stamp changes. The next scan starts over.

What this does not see: a file put in place without a ``DiskBackend`` (copied by hand, an older
OrbitKV): it is found at the next scan (an eviction's, at most every ``RESCAN_INTERVAL_S`` under
pressure, or a restart); nor a file removed without one, which stays "present" until a read
misses it (a load planned on it falls back to recomputing).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .disk_ledger import DirectoryLedger

# Past this many journaled (or missing) keys the view stops being complete until the next scan.
MAX_REMEMBERED_KEYS = 1 << 16


class DirectoryView:
    def __init__(self, ledger: DirectoryLedger, key_of: Callable[[str], str]) -> None:
        self._ledger = ledger
        self._key_of = key_of
        self._lock = threading.Lock()
        self._written: set[str] = set()
        self._misses: set[str] = set()
        self._position: tuple[int, int] | None = None
        self._stamp: bytes | None = None
        self.is_complete = False

    def start(self) -> None:
        """A scan is about to read the directory (call under the ledger's lock)."""
        with self._lock:
            self._position = self._ledger.position_locked()
            self._stamp = None
            self._written, self._misses = set(), set()
            self.is_complete = self._position is not None

    def forget(self, key: str) -> None:
        """``key``'s file is gone (deleted, or missing when opened)."""
        with self._lock:
            self._written.discard(key)

    def update(self, stamp: bytes | None) -> tuple[set[str], set[str], bool]:
        """``(written, misses, is_complete)`` at ``stamp`` (read just before): keys journaled since
        the scan, keys found absent (add to it only when not complete and ``stamp`` is not None),
        and whether a key in neither the scan nor ``written`` is absent."""
        with self._lock:
            if stamp is not None and stamp == self._stamp:
                return self._written, self._misses, self.is_complete
            position = self._position
        # The journal is read outside the view's lock: a scan starts the view under the ledger's
        # lock, so holding this one while taking that one could deadlock with it.
        got = None
        if stamp is not None and position is not None:
            got = self._ledger.written_since(*position)
        restart = self._ledger.position() if got is None and stamp is not None else None
        with self._lock:
            if self._position != position:
                pass  # another thread caught up (or a scan started) meanwhile: newer than ours
            elif got is None:
                self._lose_track(stamp, restart)
            else:
                self._apply(*got, stamp)
            return self._written, self._misses, self.is_complete

    def follow_locked(self) -> None:
        """The ledger just changed under its lock (a write or removal of this process): read the
        journal's new lines now, on the writing thread, so that the next lookup finds the stamp
        unchanged and reads nothing (a lookup runs on the scheduler's path, between two forward
        passes; this process's own writes were its only change there). Call under the ledger's
        lock."""
        stamp = self._ledger.stamp()
        with self._lock:
            if self._position is None or stamp is None:
                return  # lost track: the next lookup decides
            got = self._ledger.written_since_locked(*self._position)
            if got is None:
                self._lose_track(stamp, self._ledger.position_locked())
            else:
                self._apply(*got, stamp)

    def _apply(self, lines: list[str], epoch: int, offset: int, stamp: bytes) -> None:
        for line in lines:
            is_removed = line.startswith("-")
            try:
                key = self._key_of(line[1:] if is_removed else line)
            except (ValueError, UnicodeDecodeError):
                continue
            if is_removed:
                self._written.discard(key)
            else:
                self._written.add(key)
                self._misses.discard(key)
        self._position, self._stamp = (epoch, offset), stamp
        if len(self._written) + len(self._misses) > MAX_REMEMBERED_KEYS:
            self._lose_track(stamp, (epoch, offset))

    def _lose_track(
        self, stamp: bytes | None, position: tuple[int, int] | None = None
    ) -> None:
        """The journal cannot say what was written: stat again, remembering misses from now
        (``position``: the journal's end, read with ``stamp``; call under the view's lock)."""
        self.is_complete = False
        self._written, self._misses = set(), set()
        self._stamp = stamp
        self._position = None if stamp is None else position
