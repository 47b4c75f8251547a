"""The disk tier's directory and its files (``disk.py`` keeps the budget, the LRU and the journal).

- An entry is the file ``<root>/<shard>/<name>``: ``shard`` two hex digits of the key's xxh3,
  ``name`` the key with every byte outside ``[A-Za-z0-9_-]`` written as ``%XX`` (reversible, never
  hidden, never ``..``, never a path separator). Keys are hashes: no prompt text reaches the disk.
- A write is atomic: a private temp file ``.tmp-<tag>`` (fsync'd where asked), then ``os.replace``.
  A reader sees no file or the whole file; one left by a writer that died is removed by the next
  scan once it is older than ``STALE_TMP_AGE_S`` (a live writer's is younger).
- Reads take an open descriptor: ``read_bytes`` (one ``read``), ``read_buffer`` (into a private
  buffer, a read-only ``memoryview`` the memory tier can keep as it is).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from urllib.parse import unquote_to_bytes

import xxhash

from . import buffers

_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
# Longer names are refused (a dropped write): filesystems cap a name at 255 bytes.
MAX_NAME_NBYTES = 240
STALE_TMP_AGE_S = 300.0


def key_to_filename(key: str) -> str:
    return "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in key)


def filename_to_key(name: str) -> str:
    return unquote_to_bytes(name).decode("utf-8")


def path_of(root: str, key: str) -> str:
    """The file that holds ``key`` under ``root``."""
    shard = xxhash.xxh3_64_hexdigest(key.encode())[:2]
    return os.path.join(root, shard, key_to_filename(key))


def file_size(path: str) -> int:
    """The file's size; 0 when there is none (or it cannot be read)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def read_buffer(fd: int, size: int) -> memoryview:
    buf = buffers.take(size)
    view = memoryview(buf)
    done = 0
    while done < size:
        n = os.readv(fd, [view[done:]])
        if n <= 0:
            break  # shorter than fstat said: the decoder reports the truncation
        done += n
    return view[:done].toreadonly()


def read_bytes(fd: int, size: int) -> bytes:
    parts = []
    left = size
    while left > 0:
        part = os.read(fd, left)
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def write_atomic(path: str, value: bytes, tag: str, *, is_fsync: bool) -> None:
    """Write ``value`` as ``path`` through the temp file ``.tmp-<tag>`` beside it (``tag``: unique
    to the writing process and thread); raises ``OSError``, leaving no temp file behind."""
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".tmp-{tag}")
    os.makedirs(directory, exist_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(value)
        while view:
            view = view[os.write(fd, view) :]
        if is_fsync:
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


def scan(root: str) -> list[tuple[float, str, int]]:
    """Every entry's ``(recency, key, size)``, least recent first (recency: the later of its
    access and modify times, which reads bump); stale temp files are removed on the way."""
    found = []
    now = time.time()
    for shard in os.scandir(root):
        if not shard.is_dir(follow_symlinks=False):
            continue
        for item in os.scandir(shard.path):
            try:
                st = item.stat(follow_symlinks=False)
                if item.name.startswith("."):
                    if item.name.startswith(".tmp-") and now - st.st_mtime > STALE_TMP_AGE_S:
                        os.unlink(item.path)
                    continue
                key = filename_to_key(item.name)
            except (OSError, UnicodeDecodeError, ValueError):
                continue
            found.append((max(st.st_atime, st.st_mtime), key, st.st_size))
    found.sort()
    return found


def iter_keys(root: str, on_error: Callable[[], None]) -> Iterator[str]:
    """Every entry's key under ``root`` (``on_error``: the directory could not be listed)."""
    try:
        shards = [s.path for s in os.scandir(root) if s.is_dir(follow_symlinks=False)]
    except OSError:
        on_error()
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
