"""Recycled byte buffers for entries, so that large puts and gets do not fault in fresh memory.

A multi-MiB ``numpy.empty`` costs a page fault per page on first touch (the kernel zeroes each one,
and with transparent huge pages it may compact memory first): about as long as the copy that
follows, or far longer. glibc hands buffers above 32 MiB back to the OS on free, and trims smaller
ones at the heap top, so a store that encodes and decodes entries of the same sizes over and over
would pay that on every call. ``take`` instead returns buffers this pool allocated before and that
nobody references any more.

Whether a buffer is still in use is read from its reference count: the pool keeps every buffer it
lent, and a buffer whose only references are the pool's is free. Everything that reaches a buffer's
memory (numpy slices, memoryviews, ``torch.from_numpy`` tensors and their views, a queued write
job) holds a reference to it, directly or through the object it was derived from, so a buffer in
use is never handed out again. Memory kept idle this way is capped (``max_idle_nbytes``); tracking
is capped too (``max_lent``): a buffer past the cap is simply left to the garbage collector.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict, deque

import numpy as np

# Below this, malloc serves buffers from its free lists without faulting: pooling buys nothing.
MIN_POOLED_NBYTES = 256 << 10
DEFAULT_MAX_IDLE_NBYTES = 256 << 20
DEFAULT_MAX_LENT = 256
# Pooled buffers start on a cache line (malloc's large blocks start 16 bytes past a page): copies
# into a misaligned buffer split every 64-byte store across two lines (measured 30-40% slower).
ALIGN_NBYTES = 64


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to 1/16 of its power of two (at most 6.25% slack), 64 KiB at least."""
    grain = max(64 << 10, 1 << max(0, nbytes.bit_length() - 5))
    return -(-nbytes // grain) * grain


class BufferPool:
    def __init__(self, max_idle_nbytes: int = DEFAULT_MAX_IDLE_NBYTES,
                 max_lent: int = DEFAULT_MAX_LENT) -> None:
        self.max_idle_nbytes = max_idle_nbytes
        self.max_lent = max_lent
        self._lock = threading.Lock()
        self._lent: deque[np.ndarray] = deque()
        self._idle: OrderedDict[int, list[np.ndarray]] = OrderedDict()  # class -> buffers
        self._idle_nbytes = 0
        self.num_reused = 0
        self.num_allocated = 0
        self._free_refcount = self._calibrate()

    def _calibrate(self) -> int:
        """The reference count ``_is_free`` sees for a buffer only the pool holds (measured, not
        assumed: interpreters differ in how they count the references of locals and arguments)."""
        probe = deque([np.empty(1, dtype=np.uint8)])
        return self._count(probe, 0)

    @staticmethod
    def _count(lent: deque[np.ndarray], i: int) -> int:
        return sys.getrefcount(lent[i])

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of exactly ``nbytes`` (uninitialised, 64-byte aligned when
        pooled), recycled when possible."""
        if nbytes < MIN_POOLED_NBYTES:
            return np.empty(nbytes, dtype=np.uint8)
        cls = size_class(nbytes)
        with self._lock:
            buf = self._take_idle(cls)
            if buf is None:
                self._reclaim(cls)
                buf = self._take_idle(cls)
            if buf is None:
                # numpy asks for transparent huge pages on large arrays: a fault maps 2 MiB at once.
                buf = np.empty(cls + ALIGN_NBYTES, dtype=np.uint8)
                self.num_allocated += 1
            else:
                self.num_reused += 1
            self._lent.append(buf)
            while len(self._lent) > self.max_lent:
                self._lent.popleft()  # no longer tracked; freed by its last user
        start = -buf.__array_interface__["data"][0] % ALIGN_NBYTES
        return buf[start : start + nbytes]

    def _take_idle(self, cls: int) -> np.ndarray | None:
        bufs = self._idle.get(cls)
        if not bufs:
            return None
        buf = bufs.pop()
        if not bufs:
            del self._idle[cls]
        self._idle_nbytes -= cls
        return buf

    def _reclaim(self, wanted_cls: int) -> None:
        """Move lent buffers nobody uses any more to the idle lists, oldest first, until one of
        ``wanted_cls`` turns up."""
        i = 0
        while i < len(self._lent):
            if self._count(self._lent, i) > self._free_refcount:
                i += 1
                continue
            buf = self._lent[i]
            del self._lent[i]
            cls = buf.nbytes - ALIGN_NBYTES
            self._idle.setdefault(cls, []).append(buf)
            self._idle.move_to_end(cls)
            self._idle_nbytes += cls
            del buf
            self._trim()
            if cls == wanted_cls:
                return

    def _trim(self) -> None:
        while self._idle_nbytes > self.max_idle_nbytes and self._idle:
            cls, bufs = next(iter(self._idle.items()))
            bufs.pop(0)
            self._idle_nbytes -= cls
            if not bufs:
                del self._idle[cls]

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"buffers_reused": self.num_reused, "buffers_allocated": self.num_allocated,
                    "buffers_idle_nbytes": self._idle_nbytes, "buffers_lent": len(self._lent)}


# One pool per process: entries move between tiers and stores, and so do their buffers.
POOL = BufferPool()


def take(nbytes: int) -> np.ndarray:
    return POOL.take(nbytes)
