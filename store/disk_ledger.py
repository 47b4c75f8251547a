"""The ledger of a disk-tier directory shared by processes: its used bytes and its budget.

``<root>/.usage`` holds the directory's used bytes (and, after them, a generation count bumped on every
change: ``stamp``), read and written under an ``flock`` (and a
thread lock for this process's threads), so replicas sharing a directory account their writes and
evictions in one place. ``<root>/.budget`` records the budget the last store that opened the
directory was given; ``orbitkv store gc`` reads it (``recorded_budget``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

try:
    import fcntl
except ImportError:  # not POSIX: the ledger is then only safe within one process
    fcntl = None  # type: ignore[assignment]

USAGE_NAME = ".usage"
BUDGET_NAME = ".budget"
# Names of the entry files put in place (and ``-name`` for those removed), one per line, appended
# under the ledger lock before the stamp is bumped: a reader whose stamp changed learns which
# files came and went (``written_since``).
WRITTEN_NAME = ".written"
# Past this size a writer empties the journal and bumps its epoch (readers then forget everything).
MAX_WRITTEN_NBYTES = 1 << 20


def recorded_budget(root: str | os.PathLike) -> int | None:
    """The budget the last store that opened ``root`` recorded there (None: none recorded)."""
    try:
        with open(os.path.join(root, BUDGET_NAME)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# The ledger's generation count sits after the used bytes (which take the first 21 bytes), the
# journal's epoch after the stamp's 64 bytes.
GENERATION_OFFSET = 32
EPOCH_OFFSET = 64


class DirectoryLedger:
    """``on_error`` is called for a failed write of the ledger or the budget (the caller counts it)."""

    def __init__(self, root: str, on_error: Callable[[], None]) -> None:
        self._root = root
        self._on_error = on_error
        self._lock = threading.Lock()  # threads of this process; the flock is for the others
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        self._fd = os.open(os.path.join(root, USAGE_NAME), flags, 0o644)
        self._written_fd = os.open(os.path.join(root, WRITTEN_NAME), flags | os.O_APPEND, 0o644)
        # Called under the lock after each change of the stamp (``DirectoryView.follow_locked``).
        self.on_bump: Callable[[], None] | None = None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._lock:
            if fcntl is not None:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                if fcntl is not None:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def read_used(self) -> int:
        """The directory's used bytes (call under ``locked``)."""
        try:
            return max(0, int(os.pread(self._fd, GENERATION_OFFSET, 0).split(b"\n")[0].strip() or 0))
        except (OSError, ValueError):
            return 0

    def stamp(self) -> bytes | None:
        """What changes whenever any process writes or removes an entry through a
        ``DiskBackend``: the used bytes and a generation count after them, bumped on every write of
        the ledger and once more when an entry's file is in place. None when it cannot be read
        (nothing may then be assumed unchanged)."""
        try:
            return os.pread(self._fd, 64, 0)
        except OSError:
            return None

    def write_used(self, nbytes: int) -> None:
        """Set the directory's used bytes (call under ``locked``)."""
        try:
            os.pwrite(self._fd, f"{max(0, nbytes):<20d}\n".encode(), 0)
        except OSError:
            self._on_error()
        self._bump()

    def bump_written(self, name: str) -> None:
        """Say that the entry file ``name`` is in place: journaled, then ``stamp`` changes."""
        with self.locked():
            self.journal_locked(name)
            self._bump()

    def journal_locked(self, name: str, *, is_removed: bool = False) -> None:
        """Append to the journal that the file ``name`` was put in place (or removed: a line
        ``-name``; names never start with ``-``). Call under ``locked``."""
        try:
            if os.fstat(self._written_fd).st_size > MAX_WRITTEN_NBYTES:
                os.ftruncate(self._written_fd, 0)
                os.pwrite(self._fd, f"{self._read_epoch() + 1:<20d}\n".encode(), EPOCH_OFFSET)
            os.write(self._written_fd, f"{'-' if is_removed else ''}{name}\n".encode())
        except OSError:
            self._on_error()  # a reader that cannot follow the journal stats again

    def written_since(self, epoch: int, offset: int) -> tuple[list[str], int, int] | None:
        """The journal's lines since ``(epoch, offset)`` (a position from ``position`` or an earlier
        call): file names put in place, ``-name`` for removed ones, in order; and the position to
        ask from next time. None when the journal was emptied since, or cannot be read."""
        with self.locked():
            return self.written_since_locked(epoch, offset)

    def written_since_locked(self, epoch: int, offset: int) -> tuple[list[str], int, int] | None:
        """``written_since`` for a caller holding ``locked``."""
        try:
            now = self._read_epoch()
            size = os.fstat(self._written_fd).st_size
            data = os.pread(self._written_fd, size - offset, offset) if size > offset else b""
        except OSError:
            return None
        if now != epoch or size < offset:
            return None
        return data.decode(errors="replace").splitlines(), now, size

    def position(self) -> tuple[int, int] | None:
        """The journal's epoch and end now (``written_since`` from here), None if unread."""
        with self.locked():
            return self.position_locked()

    def position_locked(self) -> tuple[int, int] | None:
        """``position`` for a caller holding ``locked``."""
        try:
            return self._read_epoch(), os.fstat(self._written_fd).st_size
        except OSError:
            return None

    def _read_epoch(self) -> int:
        raw = os.pread(self._fd, 20, EPOCH_OFFSET).strip()
        return int(raw) if raw.isdigit() else 0

    def _bump(self) -> None:
        try:
            raw = os.pread(self._fd, 20, GENERATION_OFFSET).strip()
            generation = int(raw) if raw.isdigit() else 0
            os.pwrite(self._fd, f"{(generation + 1) % 10**19:<20d}\n".encode(), GENERATION_OFFSET)
        except OSError:
            self._on_error()
        if self.on_bump is not None:
            self.on_bump()

    def record_budget(self, budget_nbytes: int) -> None:
        tmp = os.path.join(self._root, f".tmp-budget-{os.getpid()}-{threading.get_ident()}")
        try:
            with open(tmp, "w") as f:
                f.write(f"{budget_nbytes}\n")
            os.replace(tmp, os.path.join(self._root, BUDGET_NAME))
        except OSError:
            self._on_error()

    def close(self) -> None:
        for fd in (self._fd, self._written_fd):
            try:
                os.close(fd)
            except OSError:
                pass
