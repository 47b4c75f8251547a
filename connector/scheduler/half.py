"""Scheduler half: plan what each request can reuse, and tell the worker what to load and save.

Planning (``admission.py``) only reads. The state a request carries into a step is created in
``update_state_after_alloc``. Two kinds of load reach the worker: the prefix run (tokens that extend
vLLM's computed prefix, loaded through vLLM's own connector API at admission) and holes (cached
chunks behind fresh tokens), which only the scheduler extension (``vllm_ext/hole_scheduler.py``) can serve:
it caps a prefill at the next hole (``hole_cap``), jumps the hole (``begin_jump`` / ``end_jump``),
and this half emits the hole's load in the step that jumps it, as a synchronous load before that
step's forward.

Loads need the scheduler extension (``attach_scheduler``): it keeps loaded blocks out of vLLM's
prefix cache until vLLM confirmed the step, evicts blocks whose load failed, and tells this half
where vLLM recomputes each request from (``on_recompute``). Without it OrbitKV only saves.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..chunking import chunk_at
from ..identity import ModelIdentity
from ..metadata import (
    LoadSpec,
    OrbitKVMetadata,
    OrbitKVWorkerMeta,
    blocks_for,
    slots_for,
)
from ..stats import OrbitKVStats
from .admission import Admissions
from .audit import AuditSampler, AuditVerdicts
from .planner import APPROXIMATE_MODES, Hole, LoadItem, Plan
from .reported import ReportedIndex, SchedulerView
from .request_state import ReqState
from .save_admission import SaveAdmission
from .saves import awaited_saves, check_canonicalize, emit_saves

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from orbitkv.config import OrbitKVConfig

    from ..runtime import Shared
    from ..timing import PartSeconds
    from ..vllm_ext.exact_guard import ExactGuard

logger = logging.getLogger(__name__)


class SchedulerHalf:
    def __init__(
        self, vllm_config: VllmConfig, config: OrbitKVConfig, identity: ModelIdentity,
        shared: Shared, seconds: PartSeconds | None = None,
    ) -> None:
        self._block_size = int(vllm_config.cache_config.block_size)
        self._config = config
        self._identity = identity
        self._shared = shared
        self._store = shared.store
        self._writer = shared.writer
        budget = int(config.max_local_cpu_size * (1 << 30)) if config.local_cpu else 0
        self._reported = ReportedIndex(budget)
        self._view = SchedulerView(shared, self._reported)
        self._stats = OrbitKVStats()
        audit_dir = config.audit_path if config.approximate_reuse != "off" else None
        self._verdicts = AuditVerdicts(audit_dir) if audit_dir is not None else None
        self._sampler = (
            AuditSampler(audit_dir, config.audit_fraction, identity.model_fingerprint)
            if audit_dir is not None and config.audit_fraction > 0 else None
        )
        self._num_switched_off = 0
        self._admissions = Admissions(
            vllm_config, config, identity, self._view, self._verdicts, seconds
        )
        self._reqs: dict[str, ReqState] = {}
        self._save_admission = SaveAdmission(config.save_admission, config.save_admission_keys)
        # Bytes of KV one token occupies in the paged cache (for the loaded_bytes metric).
        sides = 1 if identity.is_mla else 2
        self._token_nbytes = (
            identity.num_layers * sides * identity.num_kv_heads * identity.head_dim
            * identity.cache_dtype.itemsize
        )
        # Requests whose loads were confirmed failed, preempted or finished since the last step:
        # the worker stops holding back their saves.
        self._recovered: set[str] = set()
        # The scheduler extension's guard (exact_guard.py), told of every load as it is planned
        # into blocks, so no other request reads them before vLLM confirmed the step.
        self._guard: ExactGuard | None = None
        self._is_attached = False
        self._has_warned_unattached = False

    # -- the scheduler extension ------------------------------------------------------------------

    def attach_scheduler(self, guard: ExactGuard | None = None) -> None:
        """OrbitKV's scheduler runs this engine: loads are safe (see the module docstring)."""
        self._is_attached = True
        self._guard = guard

    def enable_holes(self, min_hole_tokens: int) -> None:
        self._admissions.min_hole_tokens = max(0, int(min_hole_tokens))

    @property
    def is_holes_enabled(self) -> bool:
        return self._admissions.min_hole_tokens > 0

    @property
    def admissions(self) -> Admissions:
        """Per request at admission: options, chunks, the prefix-cache namespace and the plan."""
        return self._admissions

    # -- planning (read-only) ---------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        try:
            self._admissions.on_new_request(request)
        except Exception:
            logger.exception("OrbitKV: cannot place request %s in vLLM's cache", request.request_id)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._is_attached and not self._has_warned_unattached:
            self._has_warned_unattached = True
            logger.error(
                "OrbitKV: loads are off: start vLLM with --scheduler-cls "
                "orbitkv.connector.vllm_ext.hole_scheduler.OrbitKVScheduler (vLLM's own scheduler keeps "
                "blocks whose load failed in its prefix cache); OrbitKV only saves"
            )
        try:
            opts, chunks, _ = self._admissions.chunks(request)
            awaited = (
                awaited_saves(
                    opts, self._admissions.keys(request), chunks, num_computed_tokens,
                    request.num_tokens,
                )
                # With no save in flight there is nothing to wait for: the keys are not named.
                if self._is_attached and (self._writer.is_saving or self._reported.is_saving)
                else []
            )
            if awaited and (
                self._writer.has_pending(awaited) or self._reported.has_pending(awaited)
            ):
                # A save this request could load is on its way to the store: ask again next step
                # rather than recompute what is about to be cached.
                return None, False
            num = self._admissions.match(
                request, num_computed_tokens, is_load_allowed=self._is_attached
            )
        except Exception:
            # The scheduler must survive a store or planning fault: serve nothing.
            logger.exception("OrbitKV: planning failed for request %s", request.request_id)
            self._stats.add("planning_errors", 1)
            self._admissions.drop_plan(request.request_id)
            return 0, False
        return num, False

    # -- state ------------------------------------------------------------------------------------

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        state = self._reqs.get(req_id)
        admission = self._admissions.admission(req_id)
        if state is None:
            opts, chunks, positions = self._admissions.chunks(request)
            state = ReqState(req_id, chunks, opts, len(request.prompt_token_ids or ()), request)
            state.positions = positions or [c.start for c in chunks]
            state.keys = self._admissions.keys(request)
            if opts.role == "canonicalize":
                state.canonicalize = check_canonicalize(
                    request, chunks, self._identity.anchor_ids, self._view, state.keys
                )
            self._reqs[req_id] = state
        else:
            state.reset_for_admission()
            self._recovered.add(req_id)
            if admission is not None:
                state.restart_prefill_stats(admission.plan.num_computed_tokens, num_external_tokens)
        state.num_admissions += 1
        if admission is None:
            return
        plan = admission.plan
        state.num_local_tokens = plan.num_computed_tokens
        state.decisions = {d.index: d for d in plan.decisions}
        if num_external_tokens != plan.num_external_tokens:
            plan = _truncate(plan, max(num_external_tokens, 0))
        # vLLM's blocks were hashed by the plan as made (never later than this: conservative).
        state.approx_from = admission.accepted(plan)
        state.plan = plan
        state.pending_plan = plan if plan.loads else None
        state.holes = list(plan.holes)
        if plan.loads and self._guard is not None:
            self._guard.begin_load(req_id, plan.loads[0].begin)
        keys = [k for item in plan.items for k in (item.key, item.patch_key) if k]
        if not keys:
            return
        self._reported.touch(keys)
        try:
            self._store.pin(keys)
            state.pinned.extend(keys)
        except Exception:
            logger.exception("OrbitKV: pinning failed; the load may miss and be recomputed")

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, OrbitKVWorkerMeta):
            self._reported.apply(meta)

    def on_recompute(self, req_id: str, num_computed_tokens: int) -> None:
        """vLLM recomputes this request from ``num_computed_tokens`` (a load failed): the ledger,
        the saves and the holes follow (called by the scheduler extension, per request)."""
        state = self._reqs.get(req_id)
        if state is None:
            return
        state.forget_from(num_computed_tokens)
        self._recovered.add(req_id)

    # -- the scheduler extension's hooks (holes) --------------------------------------------------

    def hole_cap(
        self, req_id: str, num_computed_tokens: int, num_new_tokens: int, *, is_admission: bool
    ) -> int:
        """``num_new_tokens`` cut so that this step stops at the next hole's start.

        A hole the request has already reached or passed without jumping it (an admission that
        starts inside or at it, a recovery that recomputes it) will be computed: it is dropped.
        """
        if num_new_tokens <= 0:
            return num_new_tokens
        state = self._reqs.get(req_id)
        if is_admission or state is None:
            # vLLM caps an admission before it allocates (update_state_after_alloc comes later),
            # so the holes are still the new plan's.
            admission = self._admissions.admission(req_id)
            planned = admission.plan.holes if admission is not None else ()
            holes = [h for h in planned if h.start > num_computed_tokens]
        else:
            while state.holes and state.holes[0].start <= num_computed_tokens:
                state.holes.pop(0)
            holes = state.holes
        if not holes:
            return num_new_tokens
        return min(num_new_tokens, holes[0].start - num_computed_tokens)

    def begin_jump(self, req_id: str, num_computed_tokens: int) -> Hole | None:
        """The hole starting exactly at ``num_computed_tokens``, now being jumped, or None."""
        state = self._reqs.get(req_id)
        if state is None or state.jumping is not None or not state.holes:
            return None
        if state.holes[0].start != num_computed_tokens:
            return None
        state.jumping = state.holes.pop(0)
        if self._guard is not None:
            self._guard.begin_load(req_id, state.jumping.start)
        return state.jumping

    def end_jump(self, req_id: str) -> bool:
        """After the step is built: True when the jumped hole was not scheduled (its load was not
        emitted), so the extension must undo the jump; the hole stays planned."""
        state = self._reqs.get(req_id)
        if state is None or state.jumping is None:
            return False
        state.holes.insert(0, state.jumping)
        state.jumping = None
        return True

    def count_encoded_items(self, req_id: str, num_items: int) -> None:
        state = self._reqs.get(req_id)
        if state is not None:
            state.num_encoded_items += num_items

    # -- per step ---------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OrbitKVMetadata:
        meta = OrbitKVMetadata(recovered=sorted(self._recovered))
        self._recovered = set()
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._emit_prefix_loads(state, meta)
            # Under model runner V2 a jumped request comes as a new request (its whole block list).
            self._emit_jump(state, meta, scheduler_output)
            done = new.num_computed_tokens + num_scheduled[new.req_id]
            emit_saves(state, done, meta, self._config, self._block_size, self._save_admission)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # A resumed request's new_block_ids is its whole block list, and its load
                # (planned again by get_num_new_matched_tokens) happens in this step.
                state.block_ids = list(new_blocks[0]) if new_blocks else []
                self._emit_prefix_loads(state, meta)
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            self._emit_jump(state, meta, scheduler_output)
            end = cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0)
            emit_saves(state, end, meta, self._config, self._block_size, self._save_admission)
        return meta

    def _emit_prefix_loads(self, state: ReqState, meta: OrbitKVMetadata) -> None:
        plan, state.pending_plan = state.pending_plan, None
        for item in plan.loads if plan is not None else ():
            self._emit_load(state, item, meta, is_hole=False)

    def _emit_jump(
        self, state: ReqState, meta: OrbitKVMetadata, scheduler_output: SchedulerOutput
    ) -> None:
        """The hole this request jumped in this step, loaded into its blocks before the forward."""
        if state.jumping is None:
            return
        self._emit_hole(state, state.jumping, meta)
        state.jumping = None
        # vLLM marks sync loads only for admissions; without this the worker would start the
        # hole's load after the forward that reads it.
        scheduler_output.has_sync_kv_loads = True

    def _emit_hole(self, state: ReqState, hole: Hole, meta: OrbitKVMetadata) -> None:
        for item in hole.loads:
            self._emit_load(state, item, meta, is_hole=True)

    def _emit_load(
        self, state: ReqState, item: LoadItem, meta: OrbitKVMetadata, *, is_hole: bool
    ) -> None:
        decision = state.decisions.get(item.chunk_index)
        tier = (decision.tier if decision is not None else None) or "unknown"
        bs = self._block_size
        meta.loads.append(
            LoadSpec(
                req_id=state.req_id,
                key=item.key,
                mode=item.mode,
                chunk_start=item.chunk_start,
                offset=item.begin - item.chunk_start,
                slots=slots_for(state.block_ids, bs, item.begin, item.end),
                block_ids=blocks_for(state.block_ids, bs, item.begin, item.end),
                patch_key=item.patch_key,
                position=state.positions[item.chunk_index],
                first_block_token=item.begin - item.begin % bs,
            )
        )
        state.served.add(item.chunk_index)
        state.record(item.begin, item.end, item.mode, tier, is_hole=is_hole)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._admissions.forget(req_id)
        state = self._reqs.pop(req_id, None)
        if state is None:
            return False, None
        self._recovered.add(req_id)  # the worker forgets it too
        if state.pinned:
            try:
                self._store.unpin(state.pinned)
            except Exception:
                logger.exception("OrbitKV: unpin failed")
        summary = state.summary()
        state.count_finished(self._stats, summary, self._token_nbytes)
        if self._sampler is not None and summary["num_approximate_tokens"]:
            self._offer_audit(request, state)
        # Blocks can be freed at once: saves gathered their KV during the step.
        return False, {"orbitkv": summary}

    def _offer_audit(self, request: Request, state: ReqState) -> None:
        runs = [r for r in state.runs if r.mode in APPROXIMATE_MODES]
        modalities = set()
        for run in runs:
            chunk = state.chunks[chunk_at(state.chunks, run.begin)]
            modalities.add(chunk.modality if chunk.is_mm else "text")
        outcome = self._sampler.offer(request, state.options, {r.mode for r in runs}, modalities)
        if outcome != "skipped":
            self._stats.add(f"audit.{outcome}", 1)

    def take_stats(self) -> OrbitKVStats | None:
        """Counters since the last call (vLLM adds them to the worker's every step: a step with
        nothing to report, every decode step, returns after a few attribute reads)."""
        for name, value in self._shared.take_store_faults().items():
            self._stats.add(name, value)
        admission = self._save_admission
        if admission.num_admitted or admission.num_declined:
            admitted, declined = admission.take_counts()
            self._stats.add("save_admission.admitted", admitted)
            self._stats.add("save_admission.declined", declined)
        if self._verdicts is not None and self._verdicts.num_switched_off > self._num_switched_off:
            self._stats.add(
                "audit.switched_off", self._verdicts.num_switched_off - self._num_switched_off
            )
            self._num_switched_off = self._verdicts.num_switched_off
        if not self._stats.data:  # ``add`` keeps no zero
            return None
        stats, self._stats = self._stats, OrbitKVStats()
        return stats

    @property
    def num_tracked_requests(self) -> int:
        """Requests with state or memos here (0 once every request finished: nothing leaked)."""
        return len(set(self._reqs) | self._admissions.tracked())


def _truncate(plan: Plan, num_tokens: int) -> Plan:
    """The plan's prefix run cut to its first ``num_tokens`` served tokens (vLLM may accept fewer);
    its holes stay."""
    loads = []
    left = num_tokens
    for item in plan.loads:
        if left <= 0:
            break
        n = min(left, item.num_tokens)
        loads.append(item if n == item.num_tokens else replace(item, end=item.begin + n))
        left -= n
    return replace(plan, num_external_tokens=num_tokens - max(left, 0), loads=tuple(loads))
