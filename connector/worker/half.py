"""Worker half: move chunk KV between the store and vLLM's paged cache.

Loads: ``start_load_kv`` fetches and verifies every entry the step needs (one batched ``get``, on a
fetch thread when ``load_async`` and the cache is on an accelerator, so it overlaps the layers
before the first attention; inline for a CPU cache, where a thread only contends for the cores). The
first ``wait_for_layer_load`` of the step then relocates (+ patches) and scatters every layer (one
native call for all layers and chunks on a CPU_VEC or CPU_AMX cache: ``load_stacked``, each load's
layers one view, or ``load_many``, one job a layer and load; elsewhere one layer after another);
later layers' calls return at once. Called between two layers' compute, each call starts with cold
caches: measured inside vLLM's CPU worker (bench model, 15 tokens), one layer's load took 130-200 us
there against 20-25 us in a loop, and a 3-element ``add_`` 15-19 us against 3 us. One pass pays that
once a step instead of once a layer. Nothing else writes the loaded slots during the step (the
forward writes only the scheduled tokens' slots), so a later layer's KV may land before its
attention runs. An entry that is missing or does not fit is reported through
``get_block_ids_with_load_errors``; vLLM then recomputes from that block (this needs
``kv_load_failure_policy="recompute"``; vLLM's default fails the request).

Saves (``saving.py``): after the forward, the step's listed chunks are copied out of every layer
in one call, on the forward's path or, once vLLM runs ``handle_preemptions`` before each step, on a
copier thread joined there; the background writer builds, encodes and stores the entries. A
request whose load failed is *tainted* from the failed block's first token: vLLM will recompute it
from there, so nothing it computes from there is saved (with async scheduling, the step after too)
until the scheduler reports it ``recovered``; the scheduler then saves those chunks again once
recomputed.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from orbitkv.kernels.paged import PagedLayout, check_cache
from orbitkv.kernels.paged_stacked import CacheGroup, cache_group

from ..identity import ModelIdentity
from ..metadata import OrbitKVMetadata, OrbitKVWorkerMeta
from ..stats import OrbitKVStats
from ..timing import PartSeconds
from .entry_builder import EntryBuilder
from .loading import (
    SMALL_LOAD_TOKENS,
    Staged,
    caches_by_layer,
    check_entry,
    load_batch,
    load_one,
    load_unpatched,
    slot_tensor,
    small_batch,
)
from .patching import PatchFormer
from .saving import WorkerSaves

if TYPE_CHECKING:
    from orbitkv.store.entry import Entry
    from vllm.config import VllmConfig

    from orbitkv.config import OrbitKVConfig

    from ..metadata import LoadSpec
    from ..runtime import Shared

logger = logging.getLogger(__name__)


class WorkerHalf:
    def __init__(
        self, vllm_config: VllmConfig, config: OrbitKVConfig, identity: ModelIdentity,
        shared: Shared,
        seconds: PartSeconds | None = None,
    ) -> None:
        self._vllm_config = vllm_config
        self._config = config
        self._identity = identity
        self._store = shared.store
        self._writer = shared.writer
        self._caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        # The caches in layer order where they are the model's layers once each (else None).
        self._layer_caches: list[torch.Tensor] | None = None
        # The same caches checked once for the native loads (``kernels.paged_stacked.CacheGroup``).
        self._layer_group: CacheGroup | None = None
        self._layout: PagedLayout | None = None
        self._staged: list[Staged] = []
        self._fetch: Future[list[Staged]] | None = None
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="orbitkv-fetch") if config.load_async else None
        )
        self._is_cpu = True
        # This step has loads that have not run yet (they run at the first layer's call).
        self.is_load_pending = False
        # Made with the caches (``register_kv_caches``): the layout decides where copies run.
        self._saves: WorkerSaves | None = None
        self._failed_blocks: set[int] = set()
        # req_id -> first token whose KV may have been computed over a failed load.
        self._tainted: dict[str, int] = {}
        self._stats = OrbitKVStats()
        # Writer and patch-queue totals already reported: each interval reports its own share.
        self._totals_seen: dict[str, float] = {}
        self._totals_key: tuple[float, ...] = ()
        self._shared = shared
        shared.has_worker = True
        self._entries = EntryBuilder(
            identity, shared.writer.patches, PatchFormer(shared.store, identity, config),
            is_forming_patches=config.is_forming_patches,
        )
        self._patches = self._entries.patches
        # This step's load time so far (fetch + layers), observed once per step.
        self._step_load_s = 0.0
        self._seconds = seconds if seconds is not None else PartSeconds()

    # -- registration -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        ident = self._identity
        ctx = self._vllm_config.compilation_config.static_forward_context
        for name, cache in kv_caches.items():
            layer = ctx.get(name)
            isa = getattr(layer, "isa", None) if cache.device.type == "cpu" else None
            layout = self._detect_layout(cache, isa)
            # Raises ValueError/TypeError naming the problem (amx packing, fp8, shape mismatch).
            check_cache(
                cache,
                layout,
                num_kv_heads=1 if ident.is_mla else ident.num_kv_heads,
                head_dim=None if ident.is_mla else ident.head_dim,
                dtype=ident.cache_dtype,
                isa=isa if layout in (PagedLayout.CPU_VEC, PagedLayout.CPU_AMX) else None,
            )
            if self._layout is not None and layout is not self._layout:
                raise ValueError(
                    f"OrbitKV: layer {name} has layout {layout}, others {self._layout}"
                )
            self._layout = layout
            self._layer_index[name] = extract_layer_index(name)
        self._caches = dict(kv_caches)
        self._layer_caches = caches_by_layer(self._caches, self._layer_index, ident.num_layers)
        self._is_cpu = all(c.device.type == "cpu" for c in kv_caches.values())
        self._layer_group = None
        is_native = self._layout in (PagedLayout.CPU_VEC, PagedLayout.CPU_AMX)
        if self._layer_caches and self._is_cpu and is_native:
            try:
                self._layer_group = cache_group(self._layer_caches, self._layout)
            except ValueError:
                logger.warning("OrbitKV: the layers' caches differ; loads go layer by layer")
        if self._saves is not None:
            self._saves.shutdown()
        self._saves = WorkerSaves(
            self._layer_caches, self._layout, is_mla=ident.is_mla,
            is_cpu=self._is_cpu, num_layers=ident.num_layers, writer=self._writer,
            entries=self._entries, tainted=self._tainted, seconds=self._seconds,
        )
        if self._layout is PagedLayout.CPU_AMX:
            from orbitkv.kernels.paged_amx import request_amx_permission

            request_amx_permission()  # also done by the plugin; here for module-path loads
        if self._is_cpu and self._layout in (PagedLayout.CPU_VEC, PagedLayout.CPU_AMX):
            from orbitkv.kernels import native

            native.library()  # built (or found) now, not during the first request's load
        logger.info("OrbitKV: %d layers registered, layout %s", len(kv_caches), self._layout)

    def _detect_layout(self, cache: torch.Tensor, isa: str | None) -> PagedLayout:
        if self._identity.is_mla:
            return PagedLayout.MLA
        if cache.device.type == "cpu":
            # vLLM packs bf16 caches into AMX tiles on CPUs that have them (``isa == "amx"``).
            return PagedLayout.CPU_AMX if isa == "amx" else PagedLayout.CPU_VEC
        return PagedLayout.FLASH

    # -- loads --------------------------------------------------------------------------------

    def start_load_kv(self, meta: OrbitKVMetadata) -> None:
        """The step's loads fetched (or their fetch started) and its recovered requests' saves
        let go. The connector skips it for a step with neither (``OrbitKVConnector``)."""
        self._staged = []
        self._fetch = None
        for req_id in meta.recovered:
            self._tainted.pop(req_id, None)
        self.is_load_pending = bool(meta.loads and self._caches)
        if not self.is_load_pending:
            return
        if self._pool is not None and not self._is_cpu:
            self._fetch = self._pool.submit(self._fetch_or_fail, meta)
        else:
            # On the CPU the forward runs on the same cores and under the same GIL: a fetch
            # thread only adds a hand-off (measured 8-22 ms of waiting in the first layer against
            # under 1 ms fetched inline), so the fetch runs here.
            self._staged = self._fetch_or_fail(meta)

    def _staged_loads(self) -> list[Staged]:
        """The step's verified loads, waiting for the fetch thread the first time."""
        if self._fetch is not None:
            fetch, self._fetch = self._fetch, None
            self._staged = fetch.result()
        return self._staged

    def _fetch_or_fail(self, meta: OrbitKVMetadata) -> list[Staged]:
        """``_fetch_entries``; if it fails, every load of the step is reported failed (vLLM
        recomputes them) instead of the exception reaching the engine."""
        try:
            return self._fetch_entries(meta)
        except Exception:
            logger.exception("OrbitKV: fetching %d loads failed; recomputing", len(meta.loads))
            for spec in meta.loads:
                self._fail(spec)
            return []

    def _fetch_entries(self, meta: OrbitKVMetadata) -> list[Staged]:
        started = time.perf_counter()
        staged: list[Staged] = []
        keys = sorted({k for s in meta.loads for k in (s.key, s.patch_key) if k})
        try:
            # Loads only read the tensors: memory hits come as views of the tier's buffers.
            got = self._store.get(
                keys, expect_fingerprint=self._identity.model_fingerprint, is_zero_copy=True
            )
        except Exception:
            logger.exception("OrbitKV: store.get failed; %d loads fall back", len(meta.loads))
            got = [None] * len(keys)
        checked = time.perf_counter()
        self._seconds.add("fetch", checked - started)
        entries = dict(zip(keys, got, strict=True))
        used: set[str] = set()
        device = next(iter(self._caches.values())).device
        for spec in meta.loads:
            entry = entries.get(spec.key)
            patch = entries.get(spec.patch_key) if spec.patch_key else None
            try:
                problem = check_entry(spec, entry, patch, self._identity)
            except Exception as exc:  # a malformed entry is a miss, never a crash
                problem = f"unreadable entry: {exc!r}"
            if problem:
                logger.warning("OrbitKV: load of %s failed (%s); recomputing", spec.key, problem)
                self._fail(spec)
                continue
            used.update(k for k in (spec.key, spec.patch_key) if k)
            delta = spec.position - entry.meta.start_pos
            # Off the CPU the slots go to the device now, one copy a load; on the CPU the one
            # call for every layer reads the scheduler's array (``loading.slots_of``).
            slots = None if device.type == "cpu" else slot_tensor(spec.slots, device)
            staged.append(Staged(spec, entry, patch, delta, slots, device=device))
        kv_keys = {st.spec.key for st in staged}
        for key, entry in entries.items():
            if entry is not None and key in used:
                self._stats.add("fetched_bytes", _nbytes(entry, is_checked_kv=key in kv_keys))
        now = time.perf_counter()
        self._seconds.add("check", now - checked)
        self._stats.add("load_s", now - started)
        self._step_load_s += now - started
        return staged

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self.is_load_pending or layer_name not in self._layer_index:
            return
        self.is_load_pending = False
        staged = self._staged_loads()
        if not staged:
            return
        started = time.perf_counter()
        plain = [st for st in staged if st.patch is None]
        if plain and not self._identity.is_mla and self._load_many(plain):
            staged = [st for st in staged if st.patch is not None]
        if staged:
            self._load_layers(staged)
        elapsed = time.perf_counter() - started
        self._stats.add("load_s", elapsed)
        self._step_load_s += elapsed

    def _load_many(self, staged: list[Staged]) -> bool:
        """Every layer of these unpatched loads in one native call; False where the op cannot
        take them (not a CPU_VEC or CPU_AMX cache, no compiler)."""
        if self._layout not in (PagedLayout.CPU_VEC, PagedLayout.CPU_AMX) or not self._is_cpu:
            return False
        try:
            return load_unpatched(staged, self._caches, self._layer_index,
                                  self._layer_group or self._layer_caches,
                                  self._layout, self._identity)
        except Exception:
            # Entries were checked against the model at fetch (``check_entry``): whatever still
            # fails is a miss (vLLM recomputes the blocks), never an exception in the forward.
            logger.exception("OrbitKV: loading %d chunks failed; recomputing", len(staged))
            for st in staged:
                self._fail(st.spec)
            return True

    def _load_layers(self, staged: list[Staged]) -> None:
        """Layer by layer: patched loads, and every load where ``load_many`` cannot run."""
        # The CPU_VEC op writes whole blocks of a long chunk page by page; vLLM's AMX writer goes
        # token by token, and on a GPU a launch costs more than a device copy of a chunk (about
        # 120 us of Python and launch against ~1 us a MB, on an H100), so there every unpatched
        # load joins one call per layer.
        is_capped = self._layout is not PagedLayout.CPU_AMX and self._is_cpu
        batch = small_batch(staged, SMALL_LOAD_TOKENS if is_capped else None)
        batched = {id(st) for st in batch.members}
        alone = [st for st in staged if id(st) not in batched]
        for name, cache in self._caches.items():
            li = self._layer_index.get(name)
            if li is None:
                continue
            if batch.members:
                try:
                    load_batch(batch, li, cache, self._layout, self._identity)
                except Exception:
                    logger.exception(
                        "OrbitKV: loading %d chunks failed at %s", len(batch.members), name
                    )
                    for st in batch.members:
                        self._fail(st.spec)
            for st in alone:
                try:
                    load_one(st, li, cache, self._layout, self._identity)
                except Exception:
                    # Entries are checked against the model before any layer loads
                    # (``check_entry``); whatever still fails here is a miss too, never an
                    # exception in the forward. vLLM recomputes every layer of the reported
                    # blocks, so a load that fails at any layer is safe to report now.
                    logger.exception("OrbitKV: loading %s failed at %s", st.spec.key, name)
                    self._fail(st.spec)

    def _fail(self, spec: LoadSpec) -> None:
        """Report a load's blocks to vLLM and hold back what its request computes over them."""
        self._failed_blocks.update(spec.block_ids)
        first = self._tainted.get(spec.req_id)
        token = spec.first_block_token
        self._tainted[spec.req_id] = token if first is None else min(first, token)
        self._stats.add("failed_loads", 1)
        self._stats.add("failed_load_tokens", len(spec.slots))

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._staged_loads()  # a fetch no layer waited for still reports its failures
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- saves --------------------------------------------------------------------------------

    def before_step(self) -> None:
        """vLLM's ``handle_preemptions``, run before anything writes the cache in a step: the last
        step's save copy must be done (``saving.py``). Both of vLLM's model runners call it first
        in every step, before the forward: the engine is busy from here (``_mark_step``)."""
        self._mark_step()
        self._writer.begin_forward()
        if self._saves is not None:
            self._saves.before_step()

    def _mark_step(self) -> None:
        """The engine is busy: patches wait (``patch_queue.py``)."""
        self._writer.patches.mark_step()

    def wait_for_save(
        self, meta: OrbitKVMetadata | None, *, is_forward_complete: bool = True
    ) -> None:
        try:
            self._after_forward(meta, is_forward_complete)
        finally:
            # The step's saves go to the writer, which may build them now (``forward_gate.py``).
            self._writer.end_forward()

    def _after_forward(self, meta: OrbitKVMetadata | None, is_forward_complete: bool) -> None:
        self._staged_loads()
        self._staged = []
        self.is_load_pending = False
        self._mark_step()
        if self._step_load_s:
            self._stats.observe("load_latency_s", self._step_load_s)
            self._step_load_s = 0.0
        if self._saves is None or meta is None or not meta.saves:
            return
        counts = self._saves.after_forward(meta, is_forward_complete=is_forward_complete)
        if counts.gather_s:
            self._stats.add("save_gather_s", counts.gather_s)
        if counts.num_unsafe_skipped:
            self._stats.add("unsafe_saves_skipped", counts.num_unsafe_skipped)
        if counts.num_incomplete_skipped:
            self._stats.add("incomplete_saves_skipped", counts.num_incomplete_skipped)
        if counts.num_saved:
            self._stats.add("saved_chunks", counts.num_saved)

    def take_stats(self) -> OrbitKVStats | None:
        """Counters since the last call (vLLM asks once per step)."""
        writer, patches = self._writer, self._writer.patches
        # vLLM asks on every step, decode included: the totals are named and diffed only when one
        # moved (the bytes by kind move with the entries written).
        moved = (writer.num_dropped, writer.num_failed, writer.num_written, writer.busy_s,
                 patches.num_formed, patches.num_dropped, patches.num_failed)
        if moved != self._totals_key:
            self._totals_key = moved
            totals = {
                "dropped_saves": writer.num_dropped,
                "failed_saves": writer.num_failed,
                "saved_entries": writer.num_written,
                "saved_bytes": writer.num_bytes_written,
                "seconds.save_writer": writer.busy_s,
                **{f"stored_bytes.{kind}": n for kind, n in dict(writer.nbytes_by_kind).items()},
            }
            totals.update(patches_formed=patches.num_formed, patches_dropped=patches.num_dropped,
                          patches_failed=patches.num_failed)
            for name, value in totals.items():
                self._stats.add(name, value - self._totals_seen.get(name, 0))
            self._totals_seen = totals
            # A latency is recorded with each entry written (``num_written`` moved).
            for latency in self._writer.take_latencies():
                self._stats.observe("save_latency_s", latency)
        for name, value in self._shared.take_store_faults().items():
            self._stats.add(name, value)
        if not self._stats.data:  # ``add`` keeps no zero; an observation is a list of one
            return None
        stats, self._stats = self._stats, OrbitKVStats()
        return stats

    def build_worker_meta(self) -> OrbitKVWorkerMeta | None:
        if not self._writer.has_events:  # every decode step: nothing saved or stored
            return None
        meta = OrbitKVWorkerMeta(*self._writer.drain_events())
        return None if meta.is_empty() else meta

    def shutdown(self) -> None:
        if self._saves is not None:
            self._saves.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _nbytes(entry: Entry, *, is_checked_kv: bool = False) -> int:
    """The entry's tensor bytes. A KV entry that passed ``check_entry`` holds tensors of one shape
    and dtype: one of them tells (a patch's factors differ, each is counted)."""
    tensors = entry.tensors
    if is_checked_kv and tensors:
        first = next(iter(tensors.values()))
        return len(tensors) * first.numel() * first.element_size()
    return sum(t.numel() * t.element_size() for t in tensors.values())
