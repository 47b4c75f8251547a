"""The store and the background writer, shared by the connector halves of one process.

vLLM builds the scheduler half and the worker half as two connector objects. On the CPU backend
(and any single-GPU ``uni`` executor) both live in the engine-core process: they then share one
``TieredStore`` through this registry, so the scheduler sees the worker's writes the moment they
reach the memory tier. When the halves live in different processes each builds its own store from
the same config; the scheduler then sees what reached the shared tiers (disk, Redis).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orbitkv.store.background import lower_this_thread
from orbitkv.store.keys import EntryKey, orbit_key

from .forward_gate import ForwardGate
from .metadata import StoredKey
from .timing import PartSeconds
from .worker.patch_queue import PatchLimits, PatchQueue

if TYPE_CHECKING:
    from orbitkv.store.entry import Entry
    from orbitkv.store.tiered import TieredStore

    from orbitkv.config import OrbitKVConfig

logger = logging.getLogger(__name__)

# A save job turns gathered tensors into (key, Entry) pairs; it runs on the writer thread so entry
# building and encoding (checksums) stay off the forward pass.
SaveJob = Callable[[], list[tuple[str, Any]]]
# Save latencies kept between two stats intervals (vLLM takes them every step).
MAX_LATENCIES = 4096


class SaveWriter:
    """One daemon thread feeding ``store.put_many``. Tracks what it still has to write: each save
    under its cid and the keys it writes."""

    def __init__(
        self, store: TieredStore, max_queue: int = 256, max_nbytes: int | None = None,
        patch_limits: PatchLimits | None = None, max_hold_s: float = 1.0,
    ) -> None:
        self._store = store
        # A job starts between two forwards (the worker closes the gate for each step), or after
        # max_hold_s: ``forward_gate.py``.
        self.gate = ForwardGate(max_hold_s)
        # Gathered KV waiting for (or in) the writer thread, in bytes: over ``max_nbytes`` a new
        # save is dropped (counted in ``num_dropped``), so a slow store never grows memory.
        self.max_nbytes = max_nbytes
        self.held_nbytes = 0
        self.peak_nbytes = 0
        self._queue: queue.Queue[tuple[frozenset[str], SaveJob, float, int] | None] = queue.Queue(
            max_queue
        )
        self._lock = threading.Lock()
        # Jobs submitted and not yet run to the end; ``flush`` waits on ``_idle`` for none.
        self._idle = threading.Condition(self._lock)
        self._num_unfinished = 0
        self._pending: Counter[str] = Counter()
        # Events for the worker to report to a scheduler half in another process (see scheduler/reported.py).
        self._stored: list[StoredKey] = []
        self._submitted: list[str] = []
        self._finished: list[str] = []
        self.num_dropped = 0
        self.num_failed = 0
        self.num_written = 0
        self.num_bytes_written = 0
        # Bytes stored per entry kind: canonical, conditioned, patch (this ordering), orbit.
        self.nbytes_by_kind: Counter[str] = Counter()
        # Seconds from submit to stored, per job, until the worker takes them for its stats.
        self._latencies: list[float] = []
        # CPU seconds this thread spent building and storing entries: off the forward, but on the
        # same cores (reported as the ``save_writer`` part).
        self.busy_s = 0.0
        # The patches the saved entries allow are formed off this thread, at low priority.
        limits = patch_limits if patch_limits is not None else PatchLimits()
        self.patches = PatchQueue(
            store, idle_s=limits.idle_s, max_delay_s=limits.max_delay_s,
            max_jobs=limits.max_jobs, max_nbytes=limits.max_nbytes, on_stored=self.record_stored,
        )
        # Jobs submitted while the gate was closed: handed to the thread when the forward ends
        # (``end_forward``), so it wakes once a step, never during the forward.
        self._deferred: list[tuple[frozenset[str], SaveJob, float, int]] = []
        self._thread = threading.Thread(target=self._run, name="orbitkv-save", daemon=True)
        self._thread.start()

    def submit(self, cids: frozenset[str], job: SaveJob, nbytes: int = 0) -> None:
        """Queue ``job``, which holds ``nbytes`` of gathered KV until it has run."""
        with self._lock:
            is_over = (
                self.max_nbytes is not None
                and self.held_nbytes > 0
                and self.held_nbytes + nbytes > self.max_nbytes
            )
            if not is_over:
                self._pending.update(cids)
                self._submitted.extend(cids)
                self.held_nbytes += nbytes
                self.peak_nbytes = max(self.peak_nbytes, self.held_nbytes)
                self._num_unfinished += 1
        if is_over:
            self.num_dropped += 1
            logger.warning("OrbitKV: save queue over save_queue_max_nbytes; dropped a save of %d "
                           "chunks", len(cids))
            return
        item = (cids, job, time.perf_counter(), nbytes)
        if self.gate.is_holding:
            # Waking the thread now costs the forward a context switch and a GIL hand-off, for
            # a job that would only wait for the gate.
            with self._lock:
                self._deferred.append(item)
            return
        self._put(item)

    def _put(self, item: tuple[frozenset[str], SaveJob, float, int]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            # A dropped save is a future miss, never an error: do not stall the engine.
            cids, _, _, nbytes = item
            self._done(cids, nbytes)
            self.num_dropped += 1
            logger.warning("OrbitKV: save queue full; dropped a save of %d chunks", len(cids))

    def _release_deferred(self) -> None:
        with self._lock:
            deferred, self._deferred = self._deferred, []
        for item in deferred:
            self._put(item)

    @property
    def num_deferred(self) -> int:
        """Jobs waiting for the forward's end to reach the thread."""
        return len(self._deferred)

    def begin_forward(self) -> None:
        """A step starts: jobs submitted until ``end_forward`` wait for it (``forward_gate.py``)."""
        self.gate.begin_forward()
        if self._deferred:
            # The last step never reached ``end_forward`` (vLLM's encoder-only step returns before
            # the KV connector's output): its jobs go now, held by the gate at most max_hold_s.
            self._release_deferred()

    def end_forward(self) -> None:
        """The step's forward is done: the jobs it submitted go to the writer thread, which may
        run them now."""
        self.gate.end_forward()
        if self._deferred:
            self._release_deferred()

    def has_pending(self, cids: list[str]) -> bool:
        with self._lock:
            return any(self._pending[c] for c in cids)

    @property
    def is_saving(self) -> bool:
        """Whether any save is queued or running: when none is, no request waits for one, and
        the scheduler need not name what each would wait for."""
        return bool(self._pending)

    def flush(self, timeout_s: float | None = 30.0) -> bool:
        """Wait until every submitted job has reached the store's memory tier, the patches it
        queued (``worker/patch_queue.py``) included; False when ``timeout_s`` passed first (None:
        no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._release_deferred()
        with self.gate.bypassed(), self._idle:
            while self._num_unfinished:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.patches.flush(left)

    def record_stored(
        self, items: list[tuple[str, Any]], submitted_at: float | None = None
    ) -> None:
        """Count entries put in the store (by this writer, or by the patch queue)."""
        stored = [stored_key(k, e) for k, e in items]
        with self._lock:
            self.num_written += len(items)
            self.num_bytes_written += sum(s.nbytes for s in stored)
            for (_, entry), s in zip(items, stored, strict=True):
                self.nbytes_by_kind[_kind(entry)] += s.nbytes
            self._stored.extend(stored)
            if submitted_at is not None and len(self._latencies) < MAX_LATENCIES:
                self._latencies.append(time.perf_counter() - submitted_at)

    def close(self) -> None:
        """Stop the writer thread, then the patch queue (which forms what it still holds)."""
        self._release_deferred()
        self._queue.put(None)
        self._thread.join(timeout=10)
        self.patches.close()

    def take_latencies(self) -> list[float]:
        with self._lock:
            out, self._latencies = self._latencies, []
        return out

    @property
    def has_events(self) -> bool:
        """Whether ``drain_events`` has anything (read without the lock: a miss is read next step)."""
        return bool(self._stored or self._submitted or self._finished)

    def drain_events(self) -> tuple[list[StoredKey], list[str], list[str]]:
        """Entries stored, saves queued and saves finished since the last call."""
        with self._lock:
            out = (self._stored, self._submitted, self._finished)
            self._stored, self._submitted, self._finished = [], [], []
        return out

    def _done(self, cids: frozenset[str], nbytes: int = 0) -> None:
        with self._lock:
            self._num_unfinished -= 1
            self._idle.notify_all()
            self.held_nbytes -= nbytes
            self._finished.extend(cids)
            self._pending.subtract(cids)
            for c in cids:
                if self._pending[c] <= 0:
                    del self._pending[c]

    def _run(self) -> None:
        lower_this_thread()
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                cids, job, submitted_at, nbytes = item
                item = None
                self.gate.wait_for_gap(submitted_at)
                started = time.thread_time()
                try:
                    items = job()
                    if items:
                        self._store.put_many(items)
                        self.record_stored(items, submitted_at)
                except Exception:
                    # The save path must never take the engine down; count and go on.
                    self.num_failed += 1
                    logger.exception("OrbitKV: a background save failed")
                finally:
                    del job  # its gathered tensors go before the bytes are released
                    self.busy_s += time.thread_time() - started
                    self._done(cids, nbytes)
            finally:
                self._queue.task_done()


def _kind(entry: Entry) -> str:
    """An entry's kind for the metrics; an orbit patch is a patch whose antecedent is sorted."""
    meta = entry.meta
    if meta.kind == "patch" and meta.antecedent and list(meta.antecedent) == sorted(meta.antecedent):
        if orbit_key(meta.antecedent) == meta.antecedent_hash:
            return "orbit"
    return meta.kind


def stored_key(key: str, entry: Entry) -> StoredKey:
    meta = entry.meta
    nbytes = sum(t.numel() * t.element_size() for t in entry.tensors.values())
    is_conditioned = meta.kind == "conditioned"
    return StoredKey(
        key, EntryKey.parse(key).cid, nbytes, meta.antecedent if is_conditioned else None
    )


# Store fault counters exported as connector stats: stat name -> how to read it off store.stats().
FAULT_STATS = ("store_errors", "corrupt_entries", "planning_timeouts", "dropped_store_writes")


def _store_faults(store: TieredStore) -> dict[str, float]:
    try:
        st = store.stats()
    except Exception:  # a store without stats has no faults to report
        return dict.fromkeys(FAULT_STATS, 0.0)
    return {
        # A read that failed on memory or I/O (the entry kept) is a store fault too.
        "store_errors": float(st.get("errors", 0) + st.get("read_failed", 0)),
        "corrupt_entries": float(st.get("corrupt", 0)),
        "planning_timeouts": float(
            sum(v for k, v in st.items() if k.endswith(".lookup_timeouts"))
        ),
        "dropped_store_writes": float(st.get("dropped_writes", 0)),
    }


@dataclass(slots=True)
class Shared:
    store: Any
    writer: SaveWriter
    num_users: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    faults_seen: dict[str, float] = field(default_factory=dict)
    # The store's faults_version when faults_seen was read (None: not known).
    faults_version: int | None = None
    # A worker half uses this store: a scheduler half in the same process sees the worker's
    # writes directly and must not trust its mirror of them (scheduler/reported.py), which lags.
    has_worker: bool = False
    # The process's connector time per part and side (``timing.py``): each KV connector half and
    # the encoder connector's half of that side add to it, the KV half exports it with its stats.
    scheduler_seconds: PartSeconds = field(default_factory=PartSeconds)
    worker_seconds: PartSeconds = field(default_factory=PartSeconds)

    def take_store_faults(self) -> dict[str, float]:
        """The store's fault counters moved since the last call, by either half of this process.

        Both halves call it every step: where they share this store (one process) each fault is
        reported once; where they do not (vLLM's multi-process CPU layout), each process reports
        its own store's faults, the scheduler's planning lookups included.
        """
        # Read before the counters: a fault counted in between moves it again, and is read on
        # the next call. Compared before the lock: it almost never moved.
        try:
            version = self.store.faults_version()
        except AttributeError:  # a store that cannot say: read every time
            version = None
        if version is not None and version == self.faults_version:
            return {}
        with self.lock:
            now = _store_faults(self.store)
            delta = {k: v - self.faults_seen.get(k, 0.0) for k, v in now.items()}
            self.faults_seen = now
            self.faults_version = version
        return delta


_REGISTRY: dict[str, Shared] = {}
_REGISTRY_LOCK = threading.Lock()


def acquire(config: OrbitKVConfig, store_factory: Callable[[Any], Any] | None = None) -> Shared:
    """The process's store for this config, built on first use."""
    key = repr(sorted(dataclasses.asdict(config).items()))
    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(key)
        if shared is None:
            if store_factory is None:
                from orbitkv.store.remote_check import check_config
                from orbitkv.store.tiered import TieredStore

                # A refused password or TLS setting fails the start-up here, naming remote_url;
                # an unreachable Redis only warns (its reads are misses until it answers).
                check_config(config)
                store_factory = TieredStore.from_config
            store = store_factory(config)
            writer = SaveWriter(
                store, max_queue=config.write_queue_depth, max_nbytes=config.save_queue_max_nbytes,
                max_hold_s=config.save_hold_max_s,
                patch_limits=PatchLimits(
                    idle_s=config.patch_idle_s, max_delay_s=config.patch_max_delay_s,
                    max_jobs=config.patch_queue_depth, max_nbytes=config.patch_queue_max_nbytes,
                ),
            )
            shared = Shared(store, writer)
            shared.faults_seen = _store_faults(store)
            _REGISTRY[key] = shared
        shared.num_users += 1
        return shared


def release(shared: Shared) -> None:
    """Drop one user; the last one flushes and closes the store."""
    with _REGISTRY_LOCK:
        shared.num_users -= 1
        if shared.num_users > 0:
            return
        for key, value in list(_REGISTRY.items()):
            if value is shared:
                del _REGISTRY[key]
    if not shared.writer.flush():
        logger.warning("OrbitKV: saves still queued at shutdown after 30 s; they are dropped")
    shared.writer.close()
    shared.store.flush()
    shared.store.close()
