"""``OrbitKVECConnector``: vLLM's ``ECConnectorBase``, delegating to a scheduler or worker half.

Load it beside the KV connector::

    --ec-transfer-config '{"ec_connector": "OrbitKVECConnector", "ec_role": "ec_both",
                           "ec_connector_module_path": "orbitkv.connector"}'

(``orbitkv serve`` adds it). With an empty ``ec_connector_extra_config`` it takes the OrbitKV
connector's ``kv_connector_extra_config``, so both share one store (``connector/runtime.py``): the
same tiers, budgets and writer. ``enable_encoder_cache: false`` leaves it loaded but idle.
``ec_role`` ``ec_consumer`` only loads, ``ec_producer`` only saves (in vLLM an ``ec_producer``
engine is an encoder-only instance); ``ec_both`` does both.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole

from orbitkv.config import OrbitKVConfig

from .. import runtime
from ..identity import model_identity
from ..mm_identity import metadata_resolver
from ..plugin import CONNECTOR_NAME
from ..scheduler.options import RequestRules
from .metadata import OrbitKVECMetadata
from .scheduler import ECSchedulerHalf
from .stats import OrbitKVECPromMetrics, OrbitKVECStats
from .worker import ECWorkerHalf

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _encoder_part(method: Callable[..., Any]) -> Callable[..., Any]:
    """The call's seconds added to the process's ``encoder`` part (``connector/timing.py``): the
    encoder connector's hooks are OrbitKV's own time in the engine, exported with the KV
    connector's parts (``vllm:orbitkv_seconds_total``) where the two share a store."""

    @functools.wraps(method)
    def timed(self: OrbitKVECConnector, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._seconds.add("encoder", time.perf_counter() - started)

    return timed


def encoder_config(vllm_config: VllmConfig) -> OrbitKVConfig:
    """The ``OrbitKVConfig`` of the EC connector: its own extra config, else the KV connector's."""
    extra = dict(vllm_config.ec_transfer_config.ec_connector_extra_config or {})
    kv = vllm_config.kv_transfer_config
    if not extra and kv is not None and kv.kv_connector == CONNECTOR_NAME:
        extra = dict(kv.kv_connector_extra_config or {})
    return OrbitKVConfig.from_kv_connector_extra_config(extra)


def _is_first_tp_rank() -> bool:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except (AssertionError, ImportError):  # no model-parallel group: a single rank
        return True


def _device() -> torch.device:
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return torch.device(current_platform.device_type, current_platform.current_device())
    return torch.device(current_platform.device_type)


class OrbitKVECConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        self._config = encoder_config(vllm_config)
        is_enabled = self._config.enable_encoder_cache
        if not is_enabled:
            logger.info("OrbitKV: enable_encoder_cache is off; the encoder connector stays idle")
        fingerprint = model_identity(vllm_config, self._config.anchor_tokens).model_fingerprint
        self._shared: runtime.Shared | None = runtime.acquire(self._config)
        self._scheduler: ECSchedulerHalf | None = None
        self._worker: ECWorkerHalf | None = None
        # This side's part of the process's connector time (``_encoder_part``).
        self._seconds = (self._shared.scheduler_seconds if role == ECConnectorRole.SCHEDULER
                         else self._shared.worker_seconds)
        if role == ECConnectorRole.SCHEDULER:
            self._scheduler = ECSchedulerHalf(
                self._shared.store,
                fingerprint,
                RequestRules(self._config),
                is_load_enabled=is_enabled and self.is_consumer,
                is_save_enabled=is_enabled and self.is_producer,
                metadata_fields=metadata_resolver(vllm_config, is_strict=True),
                is_client_trusted=self._config.trust_client_mm_ids,
                is_vllm_hash_used=self._config.use_vllm_mm_hashes,
            )
        else:
            self._worker = ECWorkerHalf(self._shared, fingerprint, _device(), is_saver=_is_first_tp_rank())

    @property
    def config(self) -> OrbitKVConfig:
        return self._config

    @property
    def store(self) -> Any:
        assert self._shared is not None, "the connector was shut down"
        return self._shared.store

    @property
    def scheduler(self) -> ECSchedulerHalf:
        assert self._scheduler is not None, "scheduler-side call on the worker connector"
        return self._scheduler

    @property
    def worker(self) -> ECWorkerHalf:
        assert self._worker is not None, "worker-side call on the scheduler connector"
        return self._worker

    # -- worker side ----------------------------------------------------------------------------

    def _meta(self) -> OrbitKVECMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, OrbitKVECMetadata) else None

    @_encoder_part
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None:
            self.worker.start_load_caches(encoder_cache, meta)

    @_encoder_part
    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        self.worker.save_caches(encoder_cache, mm_hash, self._meta())

    @_encoder_part
    def build_connector_worker_meta(self) -> Any:
        return self.worker.build_worker_meta()

    # -- scheduler side -------------------------------------------------------------------------

    @_encoder_part
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        return self.scheduler.ensure_cache_available(request, num_computed_tokens)

    @_encoder_part
    def has_cache_item(self, identifier: str) -> bool:
        return self.scheduler.has_cache_item(identifier)

    def take_unavailable_requests(self) -> set[str]:
        return self.scheduler.take_unavailable_requests()

    @_encoder_part
    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self.scheduler.update_state_after_alloc(request, index)

    @_encoder_part
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OrbitKVECMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    @_encoder_part
    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    @_encoder_part
    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    # -- both -----------------------------------------------------------------------------------

    def get_ec_connector_stats(self) -> OrbitKVECStats | None:
        # The worker's counters reach the scheduler half through the worker metadata (vLLM's V1
        # model runner does not collect a worker's EC stats), so only the scheduler reports.
        return self._scheduler.take_stats() if self._scheduler is not None else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> OrbitKVECStats:
        return OrbitKVECStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> OrbitKVECPromMetrics:
        """``vllm:orbitkv_encoder_*`` on vLLM's /metrics (see ``stats.py``)."""
        return OrbitKVECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            runtime.release(shared)
