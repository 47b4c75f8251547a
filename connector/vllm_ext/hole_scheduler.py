"""vLLM scheduler extension: exact stays exact (``exact_guard.py``), and cached chunks behind fresh
tokens ("holes") are served.

OrbitKV loads only under this scheduler: vLLM's own keeps blocks whose load failed in its prefix
cache under the ``recompute`` policy, and lets other requests read loaded blocks before the step
that loaded them is confirmed (``exact_guard.py`` says how this one does not).

vLLM asks a connector for cached tokens only when a request is admitted, and only for a run that
extends the computed prefix. To load a stored chunk that sits after fresh text, this subclass of
vLLM's scheduler (``--scheduler-cls orbitkv.connector.vllm_ext.hole_scheduler.OrbitKVScheduler``; ``orbitkv
serve`` sets it) does, per step, with the connector's scheduler half
(``SchedulerHalf``) holding the plan:

- **cap**: a prefill's ``num_new_tokens`` stops at the next hole's start, before vLLM picks the
  encoder inputs for the step, so the vision encoder never runs for an image that will be loaded;
- **jump**: before vLLM schedules, a running prefill that reached a hole has its
  ``num_computed_tokens`` moved to the hole's end; vLLM's normal allocation then gives the hole its
  blocks, and the half emits the hole's load for this step as a synchronous load (before the
  forward). A jumped request that is not scheduled after all is moved back;
- **carry** (model runner V2 only): V2 keeps each request's computed count on the device and moves
  it by the tokens it ran, never by what the scheduler says of a running request; it takes a
  count only from a new request. So a jumped request leaves the step's cached requests and is sent
  as a new one, as vLLM sends a resumed request under V2 (its whole block list, its tokens): V2
  drops its state for the request and adds it again at the hole's end (``carry_as_new``). A
  request vLLM truncated after a failed load (a hole's or a prefix run's) is carried the same way
  in its next step, so V2 recomputes from where vLLM restarts it;
- **recovery** is vLLM's own: a failed load is reported as invalid blocks, vLLM recomputes from the
  first one, and the half drops what it planned there; a preempted request is planned afresh.

Holes are refused, with a log line, where a jump would be wrong or unsupported: speculative
decoding, pipeline parallelism, hybrid or sliding-window KV caches, and model runner V2 unless
``enable_v2_holes`` is set (the carry has run against V2's request-state code on the CPU, not yet
on a GPU). Those engines keep OrbitKV's prefix-run reuse.

``OrbitKVScheduler`` builds the async variant (``OrbitKVAsyncScheduler``) itself when the engine
runs with async scheduling, so one class path serves both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.request import RequestStatus

from ..timing import PartSeconds
from .exact_guard import ExactGuard, load_refusal

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

CLASS_PATH = "orbitkv.connector.vllm_ext.hole_scheduler.OrbitKVScheduler"


def hole_refusal(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, is_v2_enabled: bool = False
) -> str | None:
    """Why holes cannot be served on this engine, or None when they can."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        if not is_v2_enabled:
            return (
                "vLLM's model runner V2 is on (VLLM_USE_V2_MODEL_RUNNER, its GPU default), and "
                "holes under V2 are not yet confirmed on a GPU: start vLLM with "
                "VLLM_USE_V2_MODEL_RUNNER=0 (orbitkv serve does unless the variable is set), or "
                "set enable_v2_holes: true"
            )
        if not hasattr(Scheduler, "_build_kv_connector_meta"):
            return "this vLLM's scheduler has no hook to re-send a jumped request to model runner V2"
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


def carry_as_new(
    scheduler_output: SchedulerOutput, requests: list[Request],
    block_ids: Callable[[str], tuple[list[int], ...]], *, uses_mrope: bool,
) -> list[str]:
    """Model runner V2: each of ``requests`` scheduled in this step as a running request leaves
    the step's cached requests and is sent as a new request, the way vLLM's scheduler sends a
    resumed request under V2: its whole block list (``block_ids(req_id)``), all its tokens, and
    its computed count as the scheduler has it now (a jump's hole end, a failed load's restart).
    V2's ``add_requests`` removes the state it holds for a request before adding it again, so the
    request's device-side count, block table and sampling state start from there. Returns the ids
    carried."""
    cached = scheduler_output.scheduled_cached_reqs
    scheduled = scheduler_output.num_scheduled_tokens
    carried = {
        r.request_id: r for r in requests
        if r.request_id in scheduled and r.request_id in cached.req_ids
    }
    if not carried:
        return []
    keep = [i for i, req_id in enumerate(cached.req_ids) if req_id not in carried]

    def kept(values: list[Any]) -> list[Any]:
        # new_token_ids is filled only with pipeline parallelism, where holes are refused.
        return [values[i] for i in keep] if len(values) == len(cached.req_ids) else list(values)

    scheduler_output.scheduled_cached_reqs = CachedRequestData(
        req_ids=kept(cached.req_ids),
        resumed_req_ids=set(cached.resumed_req_ids) - carried.keys(),
        new_token_ids=kept(cached.new_token_ids),
        all_token_ids={k: v for k, v in cached.all_token_ids.items() if k not in carried},
        new_block_ids=kept(cached.new_block_ids),
        num_computed_tokens=kept(cached.num_computed_tokens),
        num_output_tokens=kept(cached.num_output_tokens),
    )
    for req_id, request in carried.items():
        scheduler_output.scheduled_new_reqs.append(
            NewRequestData.from_request(
                request, block_ids(req_id), request._all_token_ids, uses_mrope=uses_mrope
            )
        )
    return list(carried)


class _OrbitKVMixin:
    """OrbitKV's duties on top of vLLM's ``Scheduler`` or ``AsyncScheduler``: exactness
    (``exact_guard.py``) always, holes where the engine allows them."""

    connector: Any
    running: list[Any]

    def _init_orbitkv(self) -> None:
        self._half = None
        self._guard = None
        self._seconds = PartSeconds()
        self._admissions = None
        # Requests jumped in the step being built (scheduled or not), by id.
        self._jumped: dict[str, Any] = {}
        # Model runner V2: requests vLLM truncated after a failed load, re-sent as new requests in
        # their next step (V2 moves a running request's count only forward: vLLM issue #49250).
        self._resync: set[str] = set()
        connector = self.connector
        half = getattr(connector, "scheduler", None) if connector is not None else None
        if half is None or not hasattr(half, "attach_scheduler"):
            logger.warning("OrbitKV scheduler: no OrbitKV connector is configured")
            return
        reason = load_refusal(self.kv_cache_config)
        if reason is not None:
            logger.warning("OrbitKV: loads are off (%s); OrbitKV only saves", reason)
            return
        # The guard's and the holes' time, beside the connector's own parts (timing.py).
        self._seconds = connector.seconds
        self._guard = ExactGuard(self, half, self.block_size)
        self._admissions = half.admissions
        half.attach_scheduler(self._guard)
        config = connector.config
        min_tokens = int(config.min_hole_tokens)
        if min_tokens <= 0:
            logger.info("OrbitKV: holes are off (min_hole_tokens=0); prefix-run reuse only")
            return
        reason = hole_refusal(
            self.vllm_config, self.kv_cache_config, is_v2_enabled=bool(config.enable_v2_holes)
        )
        if reason is not None:
            logger.warning("OrbitKV: holes are off (%s); prefix-run reuse only", reason)
            return
        half.enable_holes(min_tokens)
        self._half = half
        logger.info("OrbitKV: serving cached chunks behind fresh tokens (holes >= %d)", min_tokens)
        if self.use_v2_model_runner:
            logger.warning(
                "OrbitKV: holes under vLLM's model runner V2 (enable_v2_holes): a jumped request "
                "is re-sent as a new request; checked against V2's request-state code on the "
                "CPU, not yet confirmed on a GPU"
            )

    # -- exactness ---------------------------------------------------------------------------------

    def _get_local_prefix_cache_hit(self, request: Request) -> Any:
        guard = self._guard
        if guard is None:
            return super()._get_local_prefix_cache_hit(request)  # type: ignore[misc]
        started = time.perf_counter()
        switch = guard.before_lookup(request)
        looked_up = time.perf_counter()
        hit = super()._get_local_prefix_cache_hit(request)  # type: ignore[misc]
        resumed = time.perf_counter()
        hit, approx_from = guard.after_lookup(request, hit, switch)
        # Where the hit stops being exact, for the connector's planning of this request (vLLM
        # asks the connector right after this lookup).
        self._admissions.note_prefix_hit(request.request_id, approx_from)
        self._seconds.add("guard", looked_up - started + time.perf_counter() - resumed)
        return hit

    def _update_requests_with_invalid_blocks(
        self, requests: Iterable[Request], invalid_block_ids: set[int],
        num_scheduled_tokens: dict[str, int],
        evict_blocks: bool = True,
    ) -> tuple[set[str], int, set[int]]:
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
        if self.use_v2_model_runner:
            self._resync |= affected_ids
        return affected_ids, num_tokens, to_evict

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> Any:
        try:
            return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        finally:
            if self._guard is not None:
                started = time.perf_counter()
                self._guard.confirm(scheduler_output)
                self._seconds.add("guard", time.perf_counter() - started)

    # -- holes -------------------------------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        half = self._half
        jumped: list[tuple[Any, Any]] = []
        self._jumped = {}
        started = time.perf_counter()
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
                    self._jumped[request.request_id] = request
        self._seconds.add("holes", time.perf_counter() - started)
        try:
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._jumped = {}
        started = time.perf_counter()
        for request, hole in jumped:
            if half.end_jump(request.request_id) and request.num_computed_tokens == hole.end:
                request.num_computed_tokens = hole.start  # not scheduled: no blocks, no load
        if half is not None:
            for req_id, inputs in output.scheduled_encoder_inputs.items():
                half.count_encoded_items(req_id, len(inputs))
        self._seconds.add("holes", time.perf_counter() - started)
        if self._guard is not None:
            started = time.perf_counter()
            self._guard.register_step(output)
            self._seconds.add("guard", time.perf_counter() - started)
        return output

    def _build_kv_connector_meta(
        self, connector: KVConnectorBase_V1, scheduler_output: SchedulerOutput
    ) -> Any:
        # vLLM calls this right after it built the step's output, before anything reads it: the
        # one point where a request can still move to the new requests under V2.
        if self.use_v2_model_runner and (self._jumped or self._resync):
            moved = dict(self._jumped)
            for req_id in self._resync:
                if req_id in self.requests:
                    moved.setdefault(req_id, self.requests[req_id])
            carry_as_new(
                scheduler_output, list(moved.values()), self.kv_cache_manager.get_block_ids,
                uses_mrope=self.model_uses_mrope,
            )
            # Sent as new (carried, or resumed by vLLM) or gone: V2 has the count vLLM has.
            new_ids = {new.req_id for new in scheduler_output.scheduled_new_reqs}
            self._resync = {r for r in self._resync if r in self.requests and r not in new_ids}
        return super()._build_kv_connector_meta(connector, scheduler_output)  # type: ignore[misc]

    def _cap(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        if request.skip_reading_prefix_cache:
            return num_new_tokens  # vLLM serves such a request nothing cached: no holes either
        is_admission = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        started = time.perf_counter()
        try:
            return self._half.hole_cap(
                request.request_id, num_computed_tokens, num_new_tokens, is_admission=is_admission
            )
        finally:
            self._seconds.add("holes", time.perf_counter() - started)

    def _try_schedule_encoder_inputs(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int, *args: Any, **kw: Any
    ) -> Any:
        if self._half is not None:
            num_new_tokens = self._cap(request, num_computed_tokens, num_new_tokens)
        return super()._try_schedule_encoder_inputs(  # type: ignore[misc]
            request, num_computed_tokens, num_new_tokens, *args, **kw
        )

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
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
    def __new__(cls, vllm_config: VllmConfig | None = None, *args: Any, **kwargs: Any) -> Any:
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
