"""Process-memory tier: a byte budget with LRU eviction and pin counts.

Pins protect entries that the connector has planned to load: between the lookup and the load, LRU
must not take them. A pin count is kept per key even while the key is absent, so an entry pinned
before its (background) promotion lands is protected as soon as it arrives.

Values are kept as given when they are ``bytes``; other buffers are copied, since their owner could
change them. ``batch_put_owned`` hands over a private buffer (a read-only view nobody else can write
through) without a copy, together with a *tag*: what the store learned when it verified those bytes
(the parsed entry header). Bytes that never leave this process cannot change, so a tagged value is
not verified again on every hit; the tag goes away with the value.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from . import base
from .base import Backend

Buffer = bytes | memoryview


class MemoryBackend(Backend):
    name = "memory"

    def __init__(self, budget_nbytes: int) -> None:
        super().__init__()
        if budget_nbytes < 0:
            raise ValueError(f"budget_nbytes must be >= 0, got {budget_nbytes}")
        self.budget_nbytes = int(budget_nbytes)
        self._lock = threading.Lock()
        self._data: OrderedDict[str, tuple[Buffer, Any]] = OrderedDict()  # (value, tag), oldest first
        self._pins: dict[str, int] = {}
        self._used_nbytes = 0
        # Changes for the listener, noted under _lock and announced after it is released (in
        # order: _deliver_lock), so a listener never holds up readers.
        self._changes: list[tuple[str, list[str]]] = []
        self._deliver_lock = threading.Lock()

    @property
    def used_nbytes(self) -> int:
        return self._used_nbytes

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        base.check_keys(keys)
        with self._lock:
            return [k in self._data for k in keys]

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values as ``bytes`` (a kept view is copied; ``batch_get_tagged`` hands out the buffers)."""
        out: list[bytes | None] = []
        for item in self.batch_get_tagged(keys):
            value = None if item is None else item[0]
            out.append(value if value is None or type(value) is bytes else bytes(value))
        return out

    def batch_get_tagged(self, keys: Sequence[str]) -> list[tuple[Buffer, Any] | None]:
        """``(value, tag)`` per key (tag None when the value was never verified), None on a miss."""
        base.check_keys(keys)
        with self._lock:
            items = []
            for key in keys:
                item = self._data.get(key)
                if item is not None:
                    self._data.move_to_end(key)
                items.append(item)
        self.count_reads([None if item is None else item[0] for item in items])
        return items

    def set_tag(self, key: str, value: Buffer, tag: Any) -> None:
        """Attach ``tag`` to ``key`` if it still holds this very ``value`` object."""
        with self._lock:
            item = self._data.get(key)
            if item is not None and item[0] is value:
                self._data[key] = (value, tag)

    def batch_put(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> None:
        base.check_keys([k for k, _ in items])
        with self._lock:
            for key, value in items:
                self._put_locked(key, value if type(value) is bytes else bytes(value), None)
        self._deliver()

    def batch_put_owned(self, items: Sequence[tuple[str, Buffer, Any]]) -> None:
        """Store ``(key, value, tag)`` without copying: ``value`` is ``bytes`` or a read-only view
        of a buffer that nothing else references, so it can never change."""
        base.check_keys([k for k, _, _ in items])
        for _, value, _ in items:
            if not (type(value) is bytes or (isinstance(value, memoryview) and value.readonly)):
                raise TypeError(f"an owned value is bytes or a read-only memoryview, got {type(value)}")
        with self._lock:
            for key, value, tag in items:
                self._put_locked(key, value, tag)
        self._deliver()

    def _put_locked(self, key: str, value: Buffer, tag: Any) -> None:
        old_item = self._data.pop(key, None)
        old = None if old_item is None else old_item[0]
        if old is not None:
            self._used_nbytes -= len(old)
        if not self._make_room_locked(len(value)):
            self.counters.add(base.DROPPED_WRITES)
            if key in self._pins and old is not None:
                # Never lose a pinned entry because its replacement did not fit.
                self._data[key] = old_item
                self._used_nbytes += len(old)
            return
        self._data[key] = (value, tag)
        self._used_nbytes += len(value)
        self._note(base.STORED, [key])
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
        for key, (value, _) in self._data.items():  # oldest first
            if self._pins.get(key):
                continue
            victims.append(key)
            freed += len(value)
            if freed >= need:
                break
        if freed < need:
            return False  # the rest is pinned; evicting would not make room
        for key in victims:
            self._used_nbytes -= len(self._data.pop(key)[0])
        self.counters.add(base.EVICTIONS, len(victims))
        self._note(base.REMOVED, victims)
        return True

    def batch_delete(self, keys: Sequence[str]) -> None:
        base.check_keys(keys)
        with self._lock:
            removed = []
            for key in keys:
                item = self._data.pop(key, None)
                if item is not None:
                    self._used_nbytes -= len(item[0])
                    self.counters.add(base.DELETES)
                    removed.append(key)
            self._note(base.REMOVED, removed)
        self._deliver()

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
            self._note(base.REMOVED, list(self._data))
            self._data.clear()
            self._used_nbytes = 0
        self._deliver()

    def _note(self, change: str, keys: list[str]) -> None:
        if self.listener is not None and keys:
            self._changes.append((change, keys))

    def _deliver(self) -> None:
        if not self._changes:
            return
        with self._deliver_lock:
            with self._lock:
                changes, self._changes = self._changes, []
            for change, keys in changes:
                self.announce(change, keys)
