"""``OrbitKVConnector``: vLLM's ``KVConnectorBase_V1``, delegating to a scheduler or worker half.

Load it with::

    KVTransferConfig(kv_connector="OrbitKVConnector", kv_role="kv_both",
                     kv_load_failure_policy="recompute",
                     kv_connector_extra_config={...OrbitKVConfig keys...})

(the name is registered by the ``vllm.general_plugins`` entry point, ``plugin.py``; or add
``kv_connector_module_path="orbitkv.connector"``).

Per-request options travel in ``kv_transfer_params={"orbitkv": {...}}`` (see ``options.py``); the
finished request's ``kv_transfer_params["orbitkv"]`` reports the tokens reused per mode.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from orbitkv.config import OrbitKVConfig

from . import runtime
from .encoder import summary as encoder_summary
from .identity import model_identity
from .metadata import OrbitKVMetadata
from .scheduler import lmcache_bridge
from .scheduler.half import SchedulerHalf
from .scheduler.kv_events import ConnectorEvents
from .stats import OrbitKVPromMetrics, OrbitKVStats
from .timing import PartSeconds
from .worker.half import WorkerHalf

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _worker_hook(method: Callable[..., Any]) -> Callable[..., Any]:
    """A worker step hook counted whole: its named parts inside it (``save_wait``, ``fetch``,
    ``check``, ``save_gather``, ``save_submit``) as themselves, the rest as ``hooks``
    (``PartSeconds.add_rest``)."""

    @functools.wraps(method)
    def timed(self: OrbitKVConnector, *args: Any, **kwargs: Any) -> Any:
        seconds = self._seconds
        started, before = time.perf_counter(), seconds.on_path_s
        try:
            return method(self, *args, **kwargs)
        finally:
            seconds.add_rest("hooks", started, before)

    return timed


# The longest the scheduler half holds its seconds for a step that reports counters (a long
# request's decode steps reach /metrics at least this often).
SCHEDULER_REPORT_S = 1.0


class OrbitKVConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST
    # Until when the scheduler half may hold its seconds (perf_counter; 0: report at the next ask).
    _hold_until = 0.0
    # The bound step's metadata has neither loads nor recovered requests (``start_load_kv``).
    _is_load_quiet = False

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # The bound step's metadata has loads or saves for the per-layer hooks.
        self._has_layer_work = False
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
            # Entries are keyed per chunk, not per rank: ranks would overwrite each other's heads.
            raise ValueError(
                "OrbitKVConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 "
                f"only (got {parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size})"
            )
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._config = OrbitKVConfig.from_kv_connector_extra_config(extra)
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning(
                "OrbitKV: kv_load_failure_policy is not 'recompute': an entry evicted between "
                "planning and loading fails its request instead of being recomputed"
            )
        identity = model_identity(vllm_config, self._config.anchor_tokens)
        self._shared = runtime.acquire(self._config)
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        self._bridge: lmcache_bridge.LMCacheBridge | None = None
        self._events: ConnectorEvents | None = None
        # Shared with this side's encoder connector in this process (its ``encoder`` part).
        self._seconds = (
            self._shared.scheduler_seconds if role == KVConnectorRole.SCHEDULER
            else self._shared.worker_seconds
        )
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerHalf(
                vllm_config, self._config, identity, self._shared, self._seconds
            )
            self._bridge = lmcache_bridge.create(vllm_config, self._config, identity, self.store)
            if self._config.kv_events:
                self._events = ConnectorEvents(
                    self.store, vllm_config.cache_config.block_size, self._config.kv_events_max_queue
                )
        else:
            self._worker = WorkerHalf(vllm_config, self._config, identity, self._shared, self._seconds)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Loads run per layer (wait_for_layer_load): a full CUDA graph would replay the forward
        # without them.
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future miss, never lost data.
        return False

    @property
    def config(self) -> OrbitKVConfig:
        return self._config

    @property
    def store(self) -> Any:
        return self._shared.store

    @property
    def seconds(self) -> PartSeconds:
        """This half's time per part (``timing.py``); the scheduler extension adds its own."""
        return self._seconds

    @property
    def writer(self) -> runtime.SaveWriter:
        return self._shared.writer

    @property
    def worker(self) -> WorkerHalf:
        assert self._worker is not None, "worker-side call on the scheduler connector"
        return self._worker

    @property
    def scheduler(self) -> SchedulerHalf:
        assert self._scheduler is not None, "scheduler-side call on the worker connector"
        return self._scheduler

    # -- worker side ----------------------------------------------------------------------------

    def _meta(self) -> OrbitKVMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OrbitKVMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    @_worker_hook
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM runs this at the start of every execute_model, before anything writes the cache:
        # the last step's save copy, if it runs off the forward's path, ends here (``save_wait``).
        if self._worker is not None:
            self._worker.before_step()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # A step with nothing to load and no request recovered (every decode step, most
        # prefills) has nothing to start: ``handle_preemptions`` marked the step's start. vLLM
        # calls this right after the forward, the first hook on caches the forward evicted.
        if not self._is_load_quiet:
            self._start_load_kv()

    @_worker_hook
    def _start_load_kv(self) -> None:
        self.worker.start_load_kv(self._meta())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        is_ours = isinstance(meta, OrbitKVMetadata)
        # Saves copy every layer after the forward (``wait_for_save``): only loads need the
        # per-layer hooks.
        self._has_layer_work = not is_ours or bool(meta.loads)
        self._is_load_quiet = is_ours and not meta.loads and not meta.recovered

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._has_layer_work = False
        self._is_load_quiet = False

    def has_connector_metadata(self) -> bool:
        # vLLM's attention wrapper asks this before every layer (``kv_transfer_utils``) and calls
        # the two per-layer hooks only when True: a step with nothing to load (every decode step,
        # most prefills, every step that only saves) skips 2 x layers calls, each on cold caches.
        return self._has_layer_work and self._connector_metadata is not None

    # The two per-layer hooks run only in steps with loads (``has_connector_metadata``), each
    # between two layers' compute (cold caches: a few microseconds even to do nothing, measured
    # in vLLM's CPU worker). A layer with nothing pending returns after one attribute check,
    # untimed; the rest is timed with two clock reads, not a context manager.

    def wait_for_layer_load(self, layer_name: str) -> None:
        worker = self._worker
        if worker is None or not worker.is_load_pending:
            return
        started = time.perf_counter()
        worker.wait_for_layer_load(layer_name)
        self._seconds.add("layer_load", time.perf_counter() - started)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # A step's saves are copied out of every layer at once when its forward is done
        # (``wait_for_save``, ``worker/saving.py``), not layer by layer.
        return None

    @_worker_hook
    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        # vLLM calls this in a ``finally`` after the forward: an exception in flight means the
        # forward stopped part way, and its KV is not this step's in every layer.
        self.worker.wait_for_save(meta if isinstance(meta, OrbitKVMetadata) else None,
                                  is_forward_complete=sys.exc_info()[0] is None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        half = self._worker if self._worker is not None else self._scheduler
        # vLLM asks every step, on the step's path: its own part (``stats``), counted in the
        # step it reports (vLLM then ships the stats out).
        started = time.perf_counter()
        stats = half.take_stats() if half is not None else None
        seconds = self._seconds
        seconds.add("stats", time.perf_counter() - started)
        if stats is None:
            if seconds.is_only("stats"):
                return None  # an idle step reports nothing: its poll's seconds go with the next
            if self._worker is None and started < self._hold_until:
                # The scheduler's seconds wait for the step a request finishes in (vLLM asks
                # after ``request_finished``), so a request's own time still arrives with it,
                # and a step with nothing else to report (most decode steps) ships nothing.
                return None
            stats = OrbitKVStats()
        seconds.take_into(stats.data)
        self._hold_until = started + SCHEDULER_REPORT_S
        return stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return OrbitKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """``vllm:orbitkv_*`` metrics on vLLM's /metrics (see ``stats.py``)."""
        return OrbitKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @_worker_hook
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._bridge is not None:
            self._bridge.close()
        if self._events is not None:
            self._events.close()
        shared, self._shared = self._shared, None
        if shared is not None:
            runtime.release(shared)

    # -- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._bridge is not None:
            opts, chunks, _ = self.scheduler.admissions.chunks(request)
            if self._bridge.before_plan(request, opts, chunks):
                return None, False  # chunks imported for it are still being written: next step
        if self._events is not None:
            self._events.describe(request, lambda: self.scheduler.admissions.chunks(request)[1])
        # The scheduler's hooks are timed with two clock reads, not ``PartSeconds.timed``: the
        # first hook of a step runs on cold caches, where a context manager costs tens of us.
        started = time.perf_counter()
        try:
            return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        finally:
            self._seconds.add("plan", time.perf_counter() - started)

    def on_new_request(self, request: Request) -> None:
        # The request's chunks (content ids of its text and images) are made here, once.
        started = time.perf_counter()
        try:
            self.scheduler.on_new_request(request)
        finally:
            self._seconds.add("chunk", time.perf_counter() - started)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        started = time.perf_counter()
        try:
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        finally:
            self._seconds.add("alloc", time.perf_counter() - started)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.kv_connector_worker_meta is None:
            return  # the workers saved and stored nothing this step (every decode step)
        started = time.perf_counter()
        try:
            self.scheduler.update_connector_output(connector_output)
        finally:
            self._seconds.add("output", time.perf_counter() - started)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        started = time.perf_counter()
        try:
            return self.scheduler.build_connector_meta(scheduler_output)
        finally:
            self._seconds.add("meta", time.perf_counter() - started)

    def take_events(self) -> list[Any]:
        """OrbitKV's tier events (``kv_events``) for vLLM's KV event publisher."""
        return self._events.take() if self._events is not None else []

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._bridge is not None:
            opts, chunks, _ = self.scheduler.admissions.chunks(request)
            self._bridge.after_finish(request, opts, chunks)
        started = time.perf_counter()
        try:
            delay_free, params = self.scheduler.request_finished(request, block_ids)
        finally:
            self._seconds.add("finish", time.perf_counter() - started)
            self._hold_until = 0.0
        # The encoder connector's loads for this request (vLLM finishes it here first).
        return delay_free, encoder_summary.annotate(params, request.request_id)
