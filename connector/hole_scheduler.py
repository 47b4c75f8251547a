"""vLLM scheduler extension: exact stays exact (``exact_guard.py``), and cached chunks behind fresh
tokens ("holes") are served.

OrbitKV loads only under this scheduler: vLLM's own keeps blocks whose load failed in its prefix
cache under the ``recompute`` policy, and lets other requests read loaded blocks before the step
that loaded them is confirmed (``exact_guard.py`` says how this one does not).

vLLM asks a connector for cached tokens only when a request is admitted, and only for a run that
extends the computed prefix. To load a stored chunk that sits after fresh text, this subclass of
vLLM's scheduler (``--scheduler-cls orbitkv.connector.hole_scheduler.OrbitKVScheduler``; ``orbitkv
serve`` sets it) does three things per step, with the connector's scheduler half
(``SchedulerHalf``) holding the plan:

- **cap**: a prefill's ``num_new_tokens`` stops at the next hole's start, before vLLM picks the
  encoder inputs for the step, so the vision encoder never runs for an image that will be loaded;
- **jump**: before vLLM schedules, a running prefill that reached a hole has its
  ``num_computed_tokens`` moved to the hole's end; vLLM's normal allocation then gives the hole its
  blocks, and the half emits the hole's load for this step as a synchronous load (before the
  forward). A jumped request that is not scheduled after all is moved back;
- **recovery** is vLLM's own: a failed load is reported as invalid blocks, vLLM recomputes from the
  first one, and the half drops what it planned there; a preempted request is planned afresh.

Holes are refused, with a log line, where a jump would be wrong or unsupported: vLLM's GPU model
runner V2 (it keeps its own device-side count of computed tokens and would ignore the jump),
speculative decoding, pipeline parallelism, and hybrid or sliding-window KV caches. Those engines
keep OrbitKV's prefix-run reuse.

``OrbitKVScheduler`` builds the async variant (``OrbitKVAsyncScheduler``) itself when the engine
runs with async scheduling, so one class path serves both.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.request import RequestStatus

from .exact_guard import ExactGuard, load_refusal

logger = logging.getLogger(__name__)

CLASS_PATH = "orbitkv.connector.hole_scheduler.OrbitKVScheduler"


def hole_refusal(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """Why holes cannot be served on this engine, or None when they can."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        return (
            "vLLM's model runner V2 keeps its own count of computed tokens and would not see a "
            "scheduler jump (set VLLM_USE_V2_MODEL_RUNNER=0 to serve holes)"
        )
    if vllm_config.speculative_config is not None:
        return "speculative decoding is on"
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return "pipeline parallelism is on"
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) != 1:
        return f"the model has {len(groups)} KV cache groups (hybrid attention)"
    spec = groups[0].kv_cache_spec
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        return f"the KV cache is {type(spec).__name__}, not full attention"
    if not vllm_config.scheduler_config.enable_chunked_prefill:
        return "chunked prefill is off (a hole splits a prefill into steps)"
    return None


class _OrbitKVMixin:
    """OrbitKV's duties on top of vLLM's ``Scheduler`` or ``AsyncScheduler``: exactness
    (``exact_guard.py``) always, holes where the engine allows them."""

    connector: Any
    running: list[Any]

    def _init_orbitkv(self) -> None:
        self._half = None
        self._guard = None
        connector = self.connector
        half = getattr(connector, "scheduler", None) if connector is not None else None
        if half is None or not hasattr(half, "attach_scheduler"):
            logger.warning("OrbitKV scheduler: no OrbitKV connector is configured")
            return
        reason = load_refusal(self.kv_cache_config)
        if reason is not None:
            logger.warning("OrbitKV: loads are off (%s); OrbitKV only saves", reason)
            return
        self._guard = ExactGuard(self, half, self.block_size)
        half.attach_scheduler(self._guard)
        reason = hole_refusal(self.vllm_config, self.kv_cache_config)
        if reason is not None:
            logger.warning("OrbitKV: holes are off (%s); prefix-run reuse only", reason)
            return
        min_tokens = int(getattr(connector, "config", None).min_hole_tokens)
        if min_tokens <= 0:
            logger.info("OrbitKV: holes are off (min_hole_tokens=0); prefix-run reuse only")
            return
        half.enable_holes(min_tokens)
        self._half = half
        logger.info("OrbitKV: serving cached chunks behind fresh tokens (holes >= %d)", min_tokens)

    # -- exactness ---------------------------------------------------------------------------------

    def _get_local_prefix_cache_hit(self, request: Any) -> Any:
        guard = self._guard
        if guard is None:
            return super()._get_local_prefix_cache_hit(request)  # type: ignore[misc]
        guard.before_lookup(request)
        hit = super()._get_local_prefix_cache_hit(request)  # type: ignore[misc]
        return guard.after_lookup(request, hit)

    def _update_requests_with_invalid_blocks(
        self, requests: Any, invalid_block_ids: set[int], num_scheduled_tokens: dict[str, int],
        evict_blocks: bool = True,
    ) -> tuple[set[str], int, set[int]]:  # fmt: skip
        parent = super()._update_requests_with_invalid_blocks  # type: ignore[misc]
        if self._guard is None:
            return parent(requests, invalid_block_ids, num_scheduled_tokens, evict_blocks)
        # One request at a time: each is truncated at its own first invalid block.
        affected_ids: set[str] = set()
        affected: list[tuple[Any, int]] = []
        num_tokens = 0
        to_evict: set[int] = set()
        for request in list(requests):
            ids, num, blocks = parent([request], invalid_block_ids, num_scheduled_tokens, evict_blocks)
            if ids:
                affected_ids |= ids
                affected.append((request, num))
            num_tokens += num
            to_evict |= blocks
        self._guard.on_recomputed(affected, to_evict)
        return affected_ids, num_tokens, to_evict

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        try:
            return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        finally:
            if self._guard is not None:
                self._guard.confirm(scheduler_output)

    # -- holes -------------------------------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        half = self._half
        jumped: list[tuple[Any, Any]] = []
        for request in self.running if half is not None else ():
            # A running prefill whose last step ended at a hole: jump it. Output placeholders
            # only exist once the prompt is done (async scheduling), so they mean "not a prefill".
            if (
                request.num_output_placeholders == 0
                and request.num_computed_tokens < request.num_prompt_tokens
            ):
                hole = half.begin_jump(request.request_id, request.num_computed_tokens)
                if hole is not None:
                    request.num_computed_tokens = hole.end
                    jumped.append((request, hole))
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        for request, hole in jumped:
            if half.end_jump(request.request_id) and request.num_computed_tokens == hole.end:
                request.num_computed_tokens = hole.start  # not scheduled: no blocks, no load
        if half is not None:
            for req_id, inputs in output.scheduled_encoder_inputs.items():
                half.count_encoded_items(req_id, len(inputs))
        if self._guard is not None:
            self._guard.register_step(output)
        return output

    def _cap(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        if request.skip_reading_prefix_cache:
            return num_new_tokens  # vLLM serves such a request nothing cached: no holes either
        is_admission = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        return self._half.hole_cap(
            request.request_id, num_computed_tokens, num_new_tokens, is_admission=is_admission
        )

    def _try_schedule_encoder_inputs(
        self, request: Any, num_computed_tokens: int, num_new_tokens: int, *args: Any, **kw: Any
    ) -> Any:
        if self._half is not None:
            num_new_tokens = self._cap(request, num_computed_tokens, num_new_tokens)
        return super()._try_schedule_encoder_inputs(  # type: ignore[misc]
            request, num_computed_tokens, num_new_tokens, *args, **kw
        )

    def _reserve_prefill_lookahead(
        self, request: Any, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        # Text-only requests never reach _try_schedule_encoder_inputs: cap here too (idempotent).
        if self._half is not None:
            num_new_tokens = self._cap(request, num_computed_tokens, num_new_tokens)
        return super()._reserve_prefill_lookahead(  # type: ignore[misc]
            request, num_computed_tokens, num_new_tokens
        )


class OrbitKVAsyncScheduler(_OrbitKVMixin, AsyncScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_orbitkv()


class OrbitKVScheduler(_OrbitKVMixin, Scheduler):
    def __new__(cls, vllm_config: Any = None, *args: Any, **kwargs: Any) -> Any:
        config = vllm_config if vllm_config is not None else kwargs.get("vllm_config")
        if cls is OrbitKVScheduler and config is not None and config.scheduler_config.async_scheduling:
            # One class path for both engines: vLLM's own get_scheduler_cls does not pick the
            # async variant for a custom class. Returned fully built (not an OrbitKVScheduler,
            # so type.__call__ does not initialise it twice).
            if vllm_config is None:
                return OrbitKVAsyncScheduler(*args, **kwargs)
            return OrbitKVAsyncScheduler(vllm_config, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_orbitkv()
