"""The worker's saves: a step's listed chunks copied out of the paged cache once its forward is
done, and handed to the background writer (``runtime.SaveWriter``), which builds and stores them.

Nothing runs per layer: ``wait_for_save``, after the forward, copies the step's chunks out of
every layer in one call, so a step that only saves has no per-layer hooks at all (the connector's
``has_connector_metadata``; each such hook, between two layers' compute, started on cold caches).
A forward that raised wrote only some layers: its saves are skipped (``is_forward_complete``).

Where the copy runs: on the forward's path, until vLLM has called ``handle_preemptions``, its
barrier for connectors that save asynchronously, run at the start of every ``execute_model``
before anything writes the cache (block zeroing, loads, the forward). From then on, on a CPU_VEC
or CPU_AMX cache (the native gather, which leaves the GIL while it copies), the copy runs on a
thread of its own after the forward (one OpenMP thread), and the next step's barrier waits for
it. So the copy overlaps what vLLM does between two steps (sampling, output, scheduling) instead
of delaying the first token; its slots cannot be rewritten before it is done, even when the
request finishes or is preempted and vLLM hands its blocks to another (those are written in a
later step, after the barrier). ``save_wait`` is the time the barrier waited, ``save_copy`` the
copy's own time on its thread. On a GPU the copy stays on the forward's path.

A request whose load failed is *tainted* from the failed block's first token (``half.py``): vLLM
recomputes it from there, so nothing it computes from there is saved until the scheduler reports
it ``recovered``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from orbitkv.kernels.paged import PagedLayout

from ..metadata import OrbitKVMetadata
from ..runtime import SaveWriter
from ..timing import PartSeconds
from .entry_builder import (
    EntryBuilder,
    EntryJob,
    GatheredKV,
    gather_stacked,
    save_slots,
    token_nbytes,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SaveCounts:
    """What one step's saves did (the worker half adds them to its stats)."""

    num_saved: int = 0
    num_unsafe_skipped: int = 0
    num_incomplete_skipped: int = 0  # the forward raised, or the layers are not all here
    gather_s: float = 0.0


class WorkerSaves:
    def __init__(
        self, layer_caches: list[torch.Tensor] | None, layout: PagedLayout,
        *, is_mla: bool, is_cpu: bool, num_layers: int, writer: SaveWriter,
        entries: EntryBuilder, tainted: dict[str, int], seconds: PartSeconds,
    ) -> None:
        # Every layer a forward writes, in layer order (``loading.caches_by_layer``); None where
        # the registered caches are not the model's layers once each (shared KV layers, a
        # pipeline stage): nothing is saved.
        self._layer_caches = layer_caches
        self._layout = layout
        self._is_mla = is_mla
        self._is_cpu = is_cpu
        self._num_layers = num_layers
        self._writer = writer
        self._entries = entries
        self._tainted = tainted
        self._seconds = seconds
        self._has_warned_layers = False
        # The copy may leave the forward's path only on a CPU cache the native gather reads (one
        # thread, without the GIL), once vLLM has shown it runs the barrier (``before_step``)
        # before each step.
        self._is_deferrable = is_cpu and layout in (PagedLayout.CPU_VEC, PagedLayout.CPU_AMX)
        self.is_deferred = False
        self._copier: ThreadPoolExecutor | None = None
        self._copying: Future[tuple[torch.Tensor, float]] | None = None

    def before_step(self) -> None:
        """vLLM's ``handle_preemptions``: nothing writes the cache before this returns, so the
        previous step's copy must be done."""
        if self._is_deferrable and not self.is_deferred:
            # On vLLM's main thread's core, as every thread OrbitKV starts in a CPU worker (a
            # thread inherits its starter's affinity). Spreading them over the worker's cores
            # measured slower (docs/performance.md, the fourth session of 2026-11-26).
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="orbitkv-save-copy")
            self.is_deferred = True
        self.join()

    def join(self) -> None:
        """Wait for the copy in flight, if any (its failure is the writer's: its jobs fail)."""
        copying, self._copying = self._copying, None
        if copying is None:
            return
        started = time.perf_counter()
        try:
            _, copy_s = copying.result()
            self._seconds.add("save_copy", copy_s)
        except Exception:
            logger.exception("OrbitKV: copying a step's saves out of the cache failed")
        self._seconds.add("save_wait", time.perf_counter() - started)

    def after_forward(
        self, meta: OrbitKVMetadata | None, *, is_forward_complete: bool = True
    ) -> SaveCounts:
        """``wait_for_save``: copy (or start copying) the step's chunks, queue their entries.
        ``is_forward_complete``: False when the forward raised (vLLM calls ``wait_for_save`` in a
        ``finally``), and only some layers hold this step's KV."""
        counts = SaveCounts()
        if meta is None or not meta.saves:
            return counts
        caches = self._layer_caches
        if not is_forward_complete or caches is None:
            counts.num_incomplete_skipped = len(meta.saves)
            if caches is None and not self._has_warned_layers:
                self._has_warned_layers = True
                logger.warning("OrbitKV: the registered caches are not the model's %d layers once "
                               "each; nothing is saved", self._num_layers)
            return counts
        # Copies never overlap one another: one thread, and a step's saves wait for the last.
        self.join()
        started = time.perf_counter()
        gathered = GatheredKV(
            list(range(len(caches))), self._is_mla,
            token_nbytes(caches[0], self._layout, len(caches), is_mla=self._is_mla),
        )
        slots = save_slots(meta, caches[0].device)
        if self._copier is not None:
            gathered.copying = self._copying = self._copier.submit(self._copy, caches, slots)
        else:
            gather_started = time.perf_counter()
            gathered.tensor = gather_stacked(caches, slots, self._layout, is_mla=self._is_mla,
                                             is_cpu=self._is_cpu)
            self._seconds.add("save_gather", time.perf_counter() - gather_started)
        counts.gather_s = time.perf_counter() - started
        started = time.perf_counter()
        try:
            self._submit(meta, gathered, counts)
        finally:
            self._seconds.add("save_submit", time.perf_counter() - started)
        return counts

    def _copy(self, caches: list[torch.Tensor], slots: torch.Tensor) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        stacked = gather_stacked(caches, slots, self._layout, is_mla=self._is_mla,
                                 is_cpu=self._is_cpu, num_threads=1)
        return stacked, time.perf_counter() - started

    def _submit(self, meta: OrbitKVMetadata, gathered: GatheredKV, counts: SaveCounts) -> None:
        end = 0
        for spec in meta.saves:
            start, end = end, end + len(spec.slots)
            tainted_from = self._tainted.get(spec.req_id)
            if tainted_from is not None and spec.end > tainted_from:
                # Computed over a load that failed: vLLM recomputes it, the scheduler re-saves it.
                counts.num_unsafe_skipped += 1
                continue
            # Pending under its cid and its keys: a waiting request waits only for saves it can
            # load (``saves.awaited_saves``).
            pending = frozenset({spec.cid, *spec.keys.values()})
            self._writer.submit(
                pending, EntryJob(self._entries, spec, gathered, start, end),
                gathered.chunk_nbytes(start, end),
            )
            counts.num_saved += 1

    def shutdown(self) -> None:
        self.join()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
