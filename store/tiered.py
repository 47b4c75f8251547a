"""TieredStore: memory -> disk -> Redis, content-addressed, asked in order and promoted on hit.

- Reads: one batched call per tier for the keys still missing, top tier first. A hit below the top
  is copied up: into memory at once, into the tiers in between in the background.
- Writes: memory synchronously; every lower tier through its own ``WriteBehind`` (queue bounded
  in jobs and in bytes, ``write_queue_max_nbytes``; oldest write dropped when full, never blocking).
- Integrity: every read from disk or Redis is decoded and verified (``tiered_read``, which uses
  ``entry.decode``). A corrupt, truncated, foreign-model or newer-version entry is a miss; the bad
  copy is deleted from that tier and counted, and the next tier down is still asked for a good copy.
  A read that fails for a reason of this process (memory, I/O: ``EntryReadFailed``) is a miss too,
  counted as ``read_failed.<tier>``, but the copy is kept: it may be good.
  The memory tier holds private, immutable buffers that were verified on the way in (or are
  verified on their first read, for ``put_bytes``); a hit there is a plain copy into the caller's
  tensors, not a second verification.
- Copies: a put encodes once into a private buffer that the memory tier keeps and the background
  writers write; a get makes one copy into the caller's tensors (plus the read itself for disk or
  Redis). Without a memory tier above it, a disk hit is read straight into the tensors.
- Survivor mode: a ``conditioned`` put also adds its antecedent list to the per-CID index
  (``antecedents.py``) in every tier, so it survives restarts and is shared through Redis.
- Recency follows use across tiers: a hit refreshes the tiers below the one that served it, in the
  background and at most once per ``refresh_interval_s`` per key (disk: LRU position and file
  times; Redis: LRU clock and TTL). A lower tier that lost the entry (a Redis that restarted empty)
  gets it back, with its survivor-index line, from the copy that was just served.
- Tenancy lives in the CID (``keys.chunk_cid(..., tenant, ...)``): another tenant's entries have
  other keys, so they are never found.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from . import antecedents, base, tiered_read
from .base import Backend, Stats
from .disk import DiskBackend
from .entry import encode_verified
from .entry_decode import EntryReader
from .entry_format import CorruptEntry, Entry, EntryReadFailed, Header
from .keys import EntryKey, index_key, key_str
from .memory import MemoryBackend
from .settings import StoreSettings
from .tiers import build_tiers, check_key_matches, is_indexed
from .writeback import RecentKeys, WriteBehind

log = logging.getLogger(__name__)
AnyKey = EntryKey | str


class TieredStore:
    """See the module docstring. Build it from ``StoreSettings`` fields or an ``OrbitKVConfig``.

    ``TieredStore(memory_nbytes=..., disk_dir=..., disk_nbytes=..., redis_url=...)``,
    ``TieredStore(StoreSettings(...))``, ``TieredStore(orbitkv_config)`` or
    ``TieredStore.from_config(orbitkv_config, **overrides)``. ``backends=[...]`` replaces the tiers
    built from settings (tests, custom tiers); the first one that is a ``MemoryBackend`` is the
    synchronous top tier.
    """

    def __init__(
        self,
        settings: StoreSettings | Any | None = None,
        *,
        backends: Sequence[Backend] | None = None,
        **overrides: Any,
    ) -> None:
        if settings is None:
            settings = StoreSettings()
        elif not isinstance(settings, StoreSettings):
            settings = StoreSettings.from_config(settings)
        self.settings = dataclasses.replace(settings, **overrides)
        tiers = list(backends) if backends is not None else build_tiers(self.settings)
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        self.tiers: list[Backend] = tiers
        self.memory: MemoryBackend | None = tiers[0] if isinstance(tiers[0], MemoryBackend) else None
        s = self.settings
        self._writers: dict[int, WriteBehind] = {
            i: WriteBehind(t, num_threads=s.num_writer_threads, queue_depth=s.write_queue_depth,
                           max_batch=s.max_write_batch, max_antecedents=s.max_antecedents_per_cid,
                           max_queue_nbytes=s.write_queue_max_nbytes)
            for i, t in enumerate(tiers)
            if t is not self.memory
        }
        self.counters = Stats()
        self._pins: Counter[str] = Counter()  # only used when there is no memory tier
        self._is_closed = False
        self._refreshed = RecentKeys(s.refresh_interval_s)

    @classmethod
    def from_config(cls, cfg: Any, **overrides: Any) -> TieredStore:
        """Build from an ``OrbitKVConfig``; reads ``settings.CONFIG_ATTRIBUTES`` by name."""
        return cls(StoreSettings.from_config(cfg), **overrides)

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self.tiers]

    # -- reads -------------------------------------------------------------------------------

    def follow_other_writers(self) -> None:
        """Disk tiers follow other processes' writes off their lookups' path
        (``DiskBackend.follow_other_writers``)."""
        for tier in self.tiers:
            if isinstance(tier, DiskBackend):
                tier.follow_other_writers()

    def lookup(self, keys: Sequence[AnyKey]) -> list[str | None]:
        """Name of the first tier holding each key (no payload transfer, no verification)."""
        names = [key_str(k) for k in keys]
        found: list[str | None] = [None] * len(names)
        pending = list(range(len(names)))
        for tier in self.tiers:
            if not pending:
                break
            flags = tier.batch_exists([names[i] for i in pending])
            for i, is_there in zip(pending, flags, strict=True):
                if is_there:
                    found[i] = tier.name
            pending = [i for i in pending if found[i] is None]
        return found

    def get(
        self,
        keys: Sequence[AnyKey],
        *,
        expect_fingerprint: str | None = None,
        layers: int | Iterable[int] | None = None,
        is_zero_copy: bool = False,
    ) -> list[Entry | None]:
        """Verified entries (``layers``: only those layers), None for a miss; promotes hits.
        ``is_zero_copy``: a memory hit verified before comes as views of the tier's immutable buffer
        (no copy); for a caller that never writes to the tensors."""
        if layers is not None and not isinstance(layers, int):
            layers = list(layers)
        names = [key_str(k) for k in keys]
        out: list[Entry | None] = [None] * len(names)
        pending = list(range(len(names)))
        for level, tier in enumerate(self.tiers):
            if not pending:
                break
            wanted = [names[i] for i in pending]
            if tier is self.memory:
                got = tiered_read.read_memory(self.memory, wanted, expect_fingerprint, layers, is_zero_copy)
            elif level == 0 and isinstance(tier, DiskBackend):
                got = tiered_read.read_files(tier, wanted, expect_fingerprint, layers)
            else:
                # A buffer bound for the memory tier is verified whole, so memory can trust it afterwards.
                got = tiered_read.read_buffers(
                    tier, wanted, expect_fingerprint, layers, is_verify_all=level > 0 and self.memory is not None
                )
            hits, bad = [], []
            for i, (value, promote) in zip(pending, got, strict=True):
                if isinstance(value, CorruptEntry):
                    log.warning("dropping corrupt entry from %s: %s", tier.name, value)
                    bad.append(names[i])
                elif isinstance(value, EntryReadFailed):
                    log.warning("reading an entry from %s failed (kept): %s", tier.name, value)
                    self.counters.add(f"read_failed.{tier.name}")
                elif value is not None:
                    out[i] = value
                    if promote is not None:
                        hits.append((names[i], *promote))
            num_hits = sum(out[i] is not None for i in pending)
            self.counters.add_many(
                ((f"hits.{tier.name}", num_hits), (f"misses.{tier.name}", len(pending) - num_hits))
            )
            if bad:
                self.counters.add(f"corrupt.{tier.name}", len(bad))
                tier.batch_delete(bad)
            if hits and level:
                self._promote(hits, level, is_owned=getattr(tier, "is_private_buffers", False))
            if hits:
                self._refresh_below(level, hits)
            pending = [i for i in pending if out[i] is None]
        self.counters.add("misses", len(pending))
        return out

    def open(self, key: AnyKey, *, expect_fingerprint: str | None = None) -> EntryReader | None:
        """A verified header for streaming layer by layer (``reader.read(layers)``), or None.

        From the disk tier the reader maps the file and reads nothing else up front; it is not
        promoted (the page cache holds it). A Redis hit is promoted like ``get``. Close the reader
        when done. If a later ``read`` raises ``CorruptEntry``, call ``drop_corrupt(key, reader.tier)``
        (not for ``EntryReadFailed``: that copy may be good).
        """
        name = key_str(key)
        for level, tier in enumerate(self.tiers):
            get_view = getattr(tier, "get_view", None)
            buf = get_view(name) if get_view is not None else tier.batch_get([name])[0]
            if buf is None:
                self.counters.add(f"misses.{tier.name}")
                continue
            try:
                reader = EntryReader(buf, expect_fingerprint=expect_fingerprint)
            except CorruptEntry as exc:
                if get_view is not None:
                    buf.close()
                self.drop_corrupt(name, tier.name, exc)
                continue
            except EntryReadFailed as exc:
                if get_view is not None:
                    buf.close()
                log.warning("reading an entry from %s failed (kept): %s", tier.name, exc)
                self.counters.add(f"read_failed.{tier.name}")
                continue
            reader.tier = tier.name
            self.counters.add(f"hits.{tier.name}")
            if level and get_view is None:
                self._promote([(name, buf, None)], level, is_owned=getattr(tier, "is_private_buffers", False))
            return reader
        self.counters.add("misses")
        return None

    def drop_corrupt(self, key: AnyKey, tier_name: str, reason: object = "") -> None:
        """Delete a bad copy from one tier and count it."""
        log.warning("dropping corrupt entry from %s: %s", tier_name, reason)
        self.counters.add(f"corrupt.{tier_name}")
        self.tiers[self.tier_names.index(tier_name)].batch_delete([key_str(key)])

    def get_bytes(self, keys: Sequence[AnyKey]) -> list[bytes | None]:
        """Raw stored bytes, tier by tier, without decoding or promotion (tools, LMCache interop)."""
        names = [key_str(k) for k in keys]
        out: list[bytes | None] = [None] * len(names)
        pending = list(range(len(names)))
        for tier in self.tiers:
            if not pending:
                break
            values = tier.batch_get([names[i] for i in pending])
            for i, value in zip(pending, values, strict=True):
                out[i] = value
            pending = [i for i in pending if out[i] is None]
        return out

    def _promote(self, hits: list[tuple[str, Any, Header | None]], level: int, *, is_owned: bool) -> None:
        """Copy hits up. ``is_owned``: the values are private buffers nothing else can change
        (bytes, or the disk tier's read-only views), so memory keeps them without a copy, with the
        header that verified them (None: verified on their first memory read)."""
        for upper in range(level):
            if self.tiers[upper] is self.memory:
                owned = [(k, v, h) for k, v, h in hits if is_owned or type(v) is bytes]
                if owned:
                    self.memory.batch_put_owned(owned)
                copied = [(k, v) for k, v, _ in hits if not (is_owned or type(v) is bytes)]
                if copied:
                    self.memory.batch_put(copied)
            else:
                for key, value, _ in hits:
                    self._writers[upper].submit(key, value)
        self.counters.add("promotions", len(hits))

    def _refresh_below(self, level: int, hits: list[tuple[str, Any, Header | None]]) -> None:
        """Tell the tiers under ``level`` that these keys were just used (see the docstring)."""
        below = [i for i in self._writers if i > level]
        due = self._refreshed.take_due([name for name, _, _ in hits]) if below else set()
        for name, value, header in hits:
            if name not in due:
                continue
            meta = header.meta if header is not None else None
            antecedent = meta.antecedent if meta is not None and is_indexed(meta) else None
            for i in below:
                self._writers[i].submit(name, value, antecedent, is_refresh=True)

    # -- writes ------------------------------------------------------------------------------

    def put(self, key: AnyKey, entry: Entry) -> None:
        """Store an entry: memory now, lower tiers in the background."""
        self.put_many([(key, entry)])

    def put_many(self, items: Sequence[tuple[AnyKey, Entry]]) -> None:
        for key, entry in items:
            check_key_matches(key, entry)
        if self._is_closed:
            self.counters.add("closed.dropped_writes", len(items))
            return
        # One private buffer per entry: the memory tier keeps it (verified: we just hashed it) and
        # the background writers write that same buffer.
        encoded = [(key_str(key), *encode_verified(entry)) for key, entry in items]
        if self.memory is not None:
            # Tagged with the buffer's views, made here (a save's background thread, off the
            # engine's path) rather than by the first load, after the engine sat idle.
            self.memory.batch_put_owned(
                [(name, buf, tiered_read.viewed_tag(buf, header) or header)
                 for name, buf, header in encoded]
            )
        for writer in self._writers.values():
            for name, buf, _ in encoded:
                writer.submit(name, buf)
        if self._writers:
            # Just written below: fresh there for refresh_interval_s. Otherwise the first load of a
            # chunk saved the step before queued a refresh of it, and woke the writer, in the
            # middle of the engine's step.
            self._refreshed.take_due([name for name, _, _ in encoded])
        self.counters.add("puts", len(items))
        for key, entry in items:
            if is_indexed(entry.meta):
                self._add_antecedent(key, entry.meta.antecedent)

    def put_bytes(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Store already-encoded entries (or foreign bytes, e.g. LMCache's layout) in every tier."""
        if self._is_closed:
            self.counters.add("closed.dropped_writes", len(items))
            return
        if self.memory is not None:
            self.memory.batch_put(items)
        for writer in self._writers.values():
            for key, value in items:
                writer.submit(key, value)
        self.counters.add("puts", len(items))

    def delete(self, keys: Sequence[AnyKey]) -> None:
        """Remove keys from every tier, synchronously."""
        names = [key_str(k) for k in keys]
        self.flush()
        for tier in self.tiers:
            tier.batch_delete(names)

    # -- survivor index ----------------------------------------------------------------------

    def _add_antecedent(self, key: AnyKey, antecedent: tuple[str, ...]) -> None:
        if isinstance(key, str):
            try:
                key = EntryKey.parse(key)
            except ValueError:
                return  # not an OrbitKV key: nothing to index
        name = index_key(key.cid)
        antecedent = tuple(antecedent)
        if self.memory is not None:
            self.memory.batch_index_add([(name, antecedent)], self.settings.max_antecedents_per_cid)
        for writer in self._writers.values():
            writer.submit(name, None, antecedent)

    def batch_antecedents(self, cids: Sequence[str]) -> list[list[tuple[str, ...]]]:
        """For each CID, the antecedent lists it has conditioned entries for (union of all tiers).

        One batched read per tier: an upper tier may hold only what was added since a restart.
        """
        names = [index_key(c) for c in cids]
        merged: list[list[tuple[str, ...]]] = [[] for _ in cids]
        cap = self.settings.max_antecedents_per_cid
        for tier in self.tiers:
            for i, found in enumerate(tier.batch_index_get(names)):
                if found:
                    merged[i] = antecedents.merge_index(found, merged[i], cap)
        return merged

    # -- pins --------------------------------------------------------------------------------

    def pin(self, keys: Sequence[AnyKey]) -> None:
        """Protect keys from memory eviction until as many ``unpin`` calls."""
        names = [key_str(k) for k in keys]
        if self.memory is not None:
            self.memory.pin(names)
        else:
            self._pins.update(names)

    def unpin(self, keys: Sequence[AnyKey]) -> None:
        names = [key_str(k) for k in keys]
        if self.memory is not None:
            self.memory.unpin(names)
            return
        for name in names:
            if self._pins[name] > 1:
                self._pins[name] -= 1
            else:
                self._pins.pop(name, None)

    def pin_count(self, key: AnyKey) -> int:
        name = key_str(key)
        return self.memory.pin_count(name) if self.memory is not None else self._pins.get(name, 0)

    # -- lifecycle ---------------------------------------------------------------------------

    def has_pending_writes(self, keys: Sequence[AnyKey]) -> bool:
        """Whether a background write of any of ``keys`` to a lower tier has not finished yet
        (queued or in flight); answers at once, for callers that must not wait (the scheduler)."""
        names = [key_str(k) for k in keys]
        return any(w.has_pending(names) for w in self._writers.values())

    def flush(self, timeout_s: float | None = 30.0) -> bool:
        """Wait for background writes; False if some did not finish within ``timeout_s``."""
        return all([w.flush(timeout_s) for w in self._writers.values()])

    def stats(self) -> dict[str, float]:
        """Flat counters: ``hits.<tier>``, ``misses.<tier>``, ``corrupt.<tier>``,
        ``read_failed.<tier>``, ``misses``, ``promotions``, ``puts`` and each tier's own stats as
        ``<tier>.<name>`` (bytes read/written, dropped writes, evictions, errors, usage) plus its
        queue as ``<tier>.queue.<name>``."""
        out = dict(self.counters.snapshot())
        for level, tier in enumerate(self.tiers):
            out.update({f"{tier.name}.{k}": v for k, v in tier.stats().items()})
            if level in self._writers:
                out.update({f"{tier.name}.{k}": v for k, v in self._writers[level].stats().items()})
        for total in (base.DROPPED_WRITES, base.ERRORS, base.EVICTIONS):
            out[total] = sum(v for k, v in out.items() if k.endswith("." + total))
        out["corrupt"] = sum(v for k, v in out.items() if k.startswith("corrupt."))
        out["read_failed"] = sum(v for k, v in out.items() if k.startswith("read_failed."))
        return out

    def faults_version(self) -> int:
        """Moves whenever a fault counter of ``stats()`` does (``base.is_fault``), or one of
        another store in this process (then ``stats()`` is read once for nothing). Both
        connector halves poll the store's faults every engine step, decode steps included, and
        ``stats()`` costs about 0.1 ms (several times that on cold caches): hits, misses and
        writes move every request, faults almost never; this is one read."""
        return base.fault_events[0]

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        for writer in self._writers.values():
            writer.close()
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
