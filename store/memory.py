"""Process-memory tier: a byte budget with LRU eviction and pin counts.

Pins protect entries that the connector has planned to load: between the lookup and the load, LRU
must not take them. A pin count is kept per key even while the key is absent, so an entry pinned
before its (background) promotion lands is protected as soon as it arrives.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from . import base
from .base import Backend


class MemoryBackend(Backend):
    name = "memory"

    def __init__(self, budget_nbytes: int) -> None:
        super().__init__()
        if budget_nbytes < 0:
            raise ValueError(f"budget_nbytes must be >= 0, got {budget_nbytes}")
        self.budget_nbytes = int(budget_nbytes)
        self._lock = threading.Lock()
        self._data: OrderedDict[str, bytes] = OrderedDict()  # oldest first
        self._pins: dict[str, int] = {}
        self._used_nbytes = 0

    @property
    def used_nbytes(self) -> int:
        return self._used_nbytes

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        base.check_keys(keys)
        with self._lock:
            return [k in self._data for k in keys]

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        base.check_keys(keys)
        with self._lock:
            values = []
            for key in keys:
                value = self._data.get(key)
                if value is not None:
                    self._data.move_to_end(key)
                values.append(value)
        self.count_reads(values)
        return values

    def batch_put(self, items: Sequence[tuple[str, bytes]]) -> None:
        base.check_keys([k for k, _ in items])
        with self._lock:
            for key, value in items:
                self._put_locked(key, bytes(value))

    def _put_locked(self, key: str, value: bytes) -> None:
        old = self._data.pop(key, None)
        if old is not None:
            self._used_nbytes -= len(old)
        if not self._make_room_locked(len(value)):
            self.counters.add(base.DROPPED_WRITES)
            if key in self._pins and old is not None:
                # Never lose a pinned entry because its replacement did not fit.
                self._data[key] = old
                self._used_nbytes += len(old)
            return
        self._data[key] = value
        self._used_nbytes += len(value)
        self.counters.add(base.WRITES)
        self.counters.add(base.WRITTEN_NBYTES, len(value))

    def _make_room_locked(self, nbytes: int) -> bool:
        if nbytes > self.budget_nbytes:
            return False
        if self._used_nbytes + nbytes <= self.budget_nbytes:
            return True
        victims = []
        freed = 0
        need = self._used_nbytes + nbytes - self.budget_nbytes
        for key, value in self._data.items():  # oldest first
            if self._pins.get(key):
                continue
            victims.append(key)
            freed += len(value)
            if freed >= need:
                break
        if freed < need:
            return False  # the rest is pinned; evicting would not make room
        for key in victims:
            self._used_nbytes -= len(self._data.pop(key))
        self.counters.add(base.EVICTIONS, len(victims))
        return True

    def batch_delete(self, keys: Sequence[str]) -> None:
        base.check_keys(keys)
        with self._lock:
            for key in keys:
                value = self._data.pop(key, None)
                if value is not None:
                    self._used_nbytes -= len(value)
                    self.counters.add(base.DELETES)

    def iter_keys(self) -> Iterator[str]:
        with self._lock:
            keys = list(self._data)
        return iter(keys)

    def pin(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                count = self._pins.get(key, 0) - 1
                if count > 0:
                    self._pins[key] = count
                else:
                    self._pins.pop(key, None)

    def pin_count(self, key: str) -> int:
        with self._lock:
            return self._pins.get(key, 0)

    def stats(self) -> dict[str, float]:
        with self._lock:
            self.counters.set_gauge(base.USED_NBYTES, self._used_nbytes)
            self.counters.set_gauge(base.NUM_ENTRIES, len(self._data))
            self.counters.set_gauge("num_pinned", len(self._pins))
        self.counters.set_gauge(base.BUDGET_NBYTES, self.budget_nbytes)
        return super().stats()

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._used_nbytes = 0
