"""The scheduler's view of the store: its own ``TieredStore`` plus what the worker reported.

With vLLM's default multiprocessing on the CPU (and any multi-process executor), the worker half runs
in another process than the scheduler half. Its memory tier is then invisible to the scheduler, and
a local disk tier's index is per process. So the worker reports, every step, the entries it stored
and the saves it has queued (``OrbitKVWorkerMeta``), and the scheduler keeps a mirror: the keys with
their sizes in LRU order under the worker's memory budget, the antecedent lists for the survivor
mode, and the cids still being saved. The mirror is approximate (the worker's LRU also moves on
reads and evictions are not reported), so a planned load may find its entry gone: the worker then
reports the blocks and vLLM recomputes them (``kv_load_failure_policy="recompute"``).

In one process both sides see the same store and the mirror only repeats it, late: a key the
store has since evicted or deleted would still look present. The view then asks the store alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..metadata import OrbitKVWorkerMeta

if TYPE_CHECKING:
    from ..runtime import Shared

WORKER_TIER = "worker"


class ReportedIndex:
    def __init__(self, budget_nbytes: int, max_antecedents_per_cid: int = 32) -> None:
        self._budget = budget_nbytes
        self._max_antecedents = max_antecedents_per_cid
        self._keys: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._antecedents: dict[str, list[tuple[str, ...]]] = {}
        # Saves in flight per cid (absent: none). A plain dict: this runs every step, and a
        # Counter's arithmetic made a new Counter each time.
        self._pending: dict[str, int] = {}

    def apply(self, meta: OrbitKVWorkerMeta) -> None:
        pending = self._pending
        for cid in meta.submitted:
            pending[cid] = pending.get(cid, 0) + 1
        for cid in meta.finished:
            num = pending.get(cid, 0) - 1
            if num > 0:
                pending[cid] = num
            else:
                pending.pop(cid, None)
        for s in meta.stored:
            self._used += s.nbytes - self._keys.pop(s.key, 0)
            self._keys[s.key] = s.nbytes
            if s.antecedent is not None:
                lists = self._antecedents.setdefault(s.cid, [])
                if s.antecedent not in lists:
                    lists.append(s.antecedent)
                    del lists[: -self._max_antecedents]
        while self._used > self._budget and self._keys:
            _, nbytes = self._keys.popitem(last=False)
            self._used -= nbytes

    def touch(self, keys: Sequence[str]) -> None:
        """A planned load reads these keys: the worker's LRU moves them up, so does the mirror."""
        for key in keys:
            if key in self._keys:
                self._keys.move_to_end(key)

    def has_pending(self, cids: Sequence[str]) -> bool:
        pending = self._pending
        return any(c in pending for c in cids)

    @property
    def is_saving(self) -> bool:
        """Whether the worker reported a save not yet finished (``SaveWriter.is_saving``)."""
        return bool(self._pending)

    def lookup(self, keys: Sequence[str]) -> list[str | None]:
        return [WORKER_TIER if k in self._keys else None for k in keys]

    def antecedents(self, cids: Sequence[str]) -> list[list[tuple[str, ...]]]:
        return [list(self._antecedents.get(c, ())) for c in cids]


class SchedulerView:
    """The planner's ``StoreView``: the process's store first, the worker's reports for what it
    misses (only when the worker lives in another process: ``Shared.has_worker`` is False)."""

    def __init__(self, shared: Shared, index: ReportedIndex) -> None:
        self._shared = shared
        self._store = shared.store
        self._index = index
        self._is_following = False

    def lookup(self, keys: list[str]) -> list[str | None]:
        if not self._is_following:
            self._is_following = True
            if not self._shared.has_worker and hasattr(self._store, "follow_other_writers"):
                # The worker writes the entries from another process: a disk tier reads their
                # journal lines between requests, not in this lookup (``disk.py``).
                self._store.follow_other_writers()
        tiers = self._store.lookup(keys)
        missing = [i for i, t in enumerate(tiers) if t is None]
        if missing and not self._shared.has_worker:
            for i, t in zip(missing, self._index.lookup([keys[i] for i in missing]), strict=True):
                tiers[i] = t
        return tiers

    def batch_antecedents(self, cids: list[str]) -> list[list[tuple[str, ...]]]:
        merged = self._store.batch_antecedents(cids)
        if self._shared.has_worker:
            return merged
        for lists, extra in zip(merged, self._index.antecedents(cids), strict=True):
            lists.extend(a for a in extra if a not in lists)
        return merged
