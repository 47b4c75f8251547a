"""The batched backend interface every tier implements, and the helpers they share.

A backend stores opaque bytes under string keys. Every call is batched so that a remote tier costs one
round trip per request. A backend never raises on an I/O failure: reads return misses, writes are
dropped, and the fault is counted in ``stats()``. Programming errors (a non-str key) still raise.
"""

from __future__ import annotations

import abc
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence

from . import antecedents


class Stats:
    """Thread-safe named counters and gauges. Counters only grow; gauges are set."""

    def __init__(self, prefix: str = "") -> None:
        self._prefix = prefix
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._gauges: dict[str, float] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n
        if is_fault(name):
            # Unlocked across Stats: two racing adds may move it once, never back.
            fault_events[0] += 1

    def add_many(self, items: Iterable[tuple[str, int]]) -> None:
        """``add`` of each ``(name, n)``, under one lock (a read counts several per tier)."""
        has_fault = False
        with self._lock:
            counters = self._counters
            for name, n in items:
                counters[name] += n
                has_fault = has_fault or is_fault(name)
        if has_fault:
            fault_events[0] += 1

    def set_gauge(self, name: str, value: float) -> None:
        with self._lock:
            self._gauges[name] = value

    def get(self, name: str) -> float:
        with self._lock:
            return self._gauges.get(name, self._counters.get(name, 0))

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            merged = {**self._counters, **self._gauges}
        return {f"{self._prefix}{k}": v for k, v in sorted(merged.items())}


# fault_events[0] moves whenever a fault counter (``is_fault``) of any ``Stats`` in this process
# does: the connector's per-step fault poll compares it before it reads a store's ``stats()``.
fault_events = [0]


def is_fault(name: str) -> bool:
    """A counter the connector reports as a store fault (``runtime.FAULT_STATS``): errors, failed
    reads, corrupt entries, dropped writes, lookup timeouts (any tier's or writer's)."""
    found = _IS_FAULT.get(name)
    if found is None:
        found = name.startswith(_FAULT_PREFIXES) or name.endswith(_FAULT_SUFFIXES)
        if len(_IS_FAULT) < 4096:  # names are a few dozen fixed ones per store
            _IS_FAULT[name] = found
    return found


_IS_FAULT: dict[str, bool] = {}


_FAULT_PREFIXES = ("errors", "read_failed", "corrupt")
_FAULT_SUFFIXES = ("dropped_writes", "lookup_timeouts")

# Counter names every backend uses, so dashboards read one vocabulary.
HITS = "hits"
MISSES = "misses"
READ_NBYTES = "read_nbytes"
WRITTEN_NBYTES = "written_nbytes"
WRITES = "writes"
DROPPED_WRITES = "dropped_writes"
DELETES = "deletes"
EVICTIONS = "evictions"
ERRORS = "errors"
USED_NBYTES = "used_nbytes"
BUDGET_NBYTES = "budget_nbytes"
NUM_ENTRIES = "num_entries"

# What a tier tells its listener (routing/tier_events.py): keys it now holds, keys it dropped.
STORED = "stored"
REMOVED = "removed"
TierListener = Callable[[str, str, Sequence[str]], None]


class Backend(abc.ABC):
    """One storage tier. Implementations must be safe to call from several threads."""

    name: str = "backend"
    # Called as listener(tier name, STORED | REMOVED, keys) when entries arrive or leave (put,
    # eviction, delete); it must be quick and must not call back into the tier. None: no events.
    listener: TierListener | None = None

    def __init__(self) -> None:
        self._index_lock = threading.Lock()
        self.counters = Stats()
        for name in (HITS, MISSES, READ_NBYTES, WRITTEN_NBYTES, WRITES, DROPPED_WRITES, DELETES,
                     EVICTIONS, ERRORS):
            self.counters.add(name, 0)  # every counter is reported, even before it moves

    @abc.abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[bool]: ...

    @abc.abstractmethod
    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]: ...

    @abc.abstractmethod
    def batch_put(self, items: Sequence[tuple[str, bytes]]) -> None: ...

    @abc.abstractmethod
    def batch_delete(self, keys: Sequence[str]) -> None: ...

    def batch_touch(self, keys: Sequence[str]) -> list[bool]:
        """Mark keys as just used (their recency, and TTL where a tier has one); True per key
        that is present. This default only answers presence: a tier with its own recency
        (disk, Redis) overrides it."""
        return self.batch_exists(keys)

    @abc.abstractmethod
    def iter_keys(self) -> Iterator[str]: ...

    # -- the survivor index (antecedents.py) ------------------------------------------------------

    def batch_index_add(self, items: Sequence[tuple[str, antecedents.Antecedent]], max_len: int) -> None:
        """Add ``(index key, antecedent)`` pairs, keeping at most ``max_len`` per key, atomically.

        This default is a read-modify-write of the JSON value under a lock: atomic within this
        process. A tier shared between processes overrides it (disk: ``flock``; Redis: sorted-set
        commands, each atomic on the server).
        """
        check_keys([k for k, _ in items])
        grouped: dict[str, list[antecedents.Antecedent]] = {}
        for key, antecedent in items:
            grouped.setdefault(key, []).append(tuple(antecedent))
        with self._index_lock:
            keys = list(grouped)
            current = self.batch_get(keys)
            self.batch_put(
                [(k, antecedents.add_to_value(v, grouped[k], max_len)) for k, v in zip(keys, current, strict=True)]
            )

    def batch_index_get(self, keys: Sequence[str]) -> list[list[antecedents.Antecedent] | None]:
        """The stored antecedents per index key, oldest first; None if absent. A corrupt value is
        deleted, counted as ``corrupt_index`` and read as absent."""
        out: list[list[antecedents.Antecedent] | None] = []
        bad = []
        for key, value in zip(keys, self.batch_get(keys), strict=True):
            parsed = None
            if value is not None:
                try:
                    parsed = antecedents.decode_index(value)
                except ValueError:
                    bad.append(key)
            out.append(parsed)
        if bad:
            self.counters.add("corrupt_index", len(bad))
            self.batch_delete(bad)
        return out

    def stats(self) -> dict[str, float]:
        return self.counters.snapshot()


    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        pass

    def announce(self, change: str, keys: Sequence[str]) -> None:
        listener = self.listener
        if listener is not None and keys:
            listener(self.name, change, keys)

    def count_reads(self, values: Sequence[bytes | None]) -> None:
        """Shared hit/miss/byte accounting for a ``batch_get`` result."""
        num_hits = nbytes = 0
        for v in values:
            if v is not None:
                num_hits += 1
                nbytes += len(v)
        self.counters.add_many(
            ((HITS, num_hits), (MISSES, len(values) - num_hits), (READ_NBYTES, nbytes))
        )

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_keys(keys: Sequence[str]) -> None:
    for key in keys:
        if not isinstance(key, str) or not key:
            raise TypeError(f"store keys are non-empty str, got {key!r}")
