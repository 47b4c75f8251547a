"""Scheduler half: plan what each request can reuse, and tell the worker what to load and save.

vLLM calls ``get_num_new_matched_tokens`` again and again while a request waits (and again after a
preemption), so it only reads: the store through its batched lookups, and two memo tables keyed by
request id (the request's chunks, a pure function of its prompt, and the last plan, overwritten on
every call). The state a request carries into a step is created in ``update_state_after_alloc``.

Two kinds of load reach the worker: the prefix run (tokens that extend vLLM's computed prefix,
loaded through vLLM's own connector API at admission) and holes (cached chunks behind fresh
tokens), which only the scheduler extension (``hole_scheduler.py``) can serve: it caps a prefill
at the next hole (``hole_cap``), jumps the hole (``begin_jump`` / ``end_jump``), and this half emits
the hole's load in the step that jumps it, as a synchronous load before that step's forward.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from .chunking import Chunk, KeyContext, chunk_prompt, mm_spans_from_features
from .identity import ModelIdentity, line_end_ids
from .metadata import (
    LoadSpec,
    OrbitKVMetadata,
    OrbitKVWorkerMeta,
    blocks_for,
    slots_for,
)
from .options import RequestOptions, configured_modes, mode_filter, parse_options
from .planner import EXACT, Hole, LoadItem, Plan, plan_request
from .reported import ReportedIndex, SchedulerView
from .request_state import ReqState
from .saves import check_canonicalize, emit_saves
from .stats import OrbitKVStats

logger = logging.getLogger(__name__)


class SchedulerHalf:
    def __init__(self, vllm_config: Any, config: Any, identity: ModelIdentity, shared: Any) -> None:
        self._block_size = int(vllm_config.cache_config.block_size)
        self._config = config
        self._identity = identity
        self._shared = shared
        self._store = shared.store
        self._writer = shared.writer
        budget = int(config.max_local_cpu_size * (1 << 30)) if config.local_cpu else 0
        self._reported = ReportedIndex(budget)
        self._view = SchedulerView(shared.store, self._reported, lambda: shared.has_worker)
        self._modes = configured_modes(config)
        self._mode_filter = mode_filter(config)
        self._line_end_ids = (
            line_end_ids(vllm_config) if config.text_chunking == "content" else frozenset()
        )
        self._reqs: dict[str, ReqState] = {}
        self._chunk_memo: dict[str, tuple[RequestOptions, list[Chunk], list[int] | None]] = {}
        self._plan_memo: dict[str, Plan] = {}
        self._stats = OrbitKVStats()
        # Set by the scheduler extension when it can serve holes (0: prefix runs only).
        self._min_hole_tokens = 0

    # -- planning (read-only) -----------------------------------------------------------------

    def _options(self, request: Any) -> RequestOptions:
        return parse_options(
            request.kv_transfer_params,
            default_modes=self._modes,
            default_tenant=self._config.tenant,
        )

    def _chunks(self, request: Any) -> tuple[RequestOptions, list[Chunk], list[int] | None]:
        """Options, chunks and each chunk's start position in the model's units (None: this
        prompt cannot be placed, so chunks are served only where they were stored)."""
        memo = self._chunk_memo.get(request.request_id)
        if memo is not None:
            return memo
        opts = self._options(request)
        ctx = KeyContext(
            self._identity.model_fingerprint,
            self._identity.layout,
            opts.tenant,
            str(getattr(request, "cache_salt", None) or ""),
        )
        try:
            chunks = chunk_prompt(
                list(request.prompt_token_ids or ()),
                mm_spans_from_features(getattr(request, "mm_features", None)),
                self._config.chunk_size,
                ctx,
                anchor_ids=self._identity.anchor_ids,
                boundaries=opts.chunk_boundaries,
                text_chunking=self._config.text_chunking,
                line_end_ids=self._line_end_ids,
            )
        except (TypeError, ValueError):
            # A prompt the chunker cannot split (e.g. overlapping items) is simply not cached.
            logger.exception("OrbitKV: cannot chunk request %s", request.request_id)
            chunks = []
        position_of = self._identity.positions.for_request(
            list(request.prompt_token_ids or ()), getattr(request, "mm_features", None) or ()
        )
        positions = [position_of(c.start) for c in chunks] if position_of is not None else None
        self._chunk_memo[request.request_id] = memo = (opts, chunks, positions)
        return memo

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        try:
            opts, chunks, positions = self._chunks(request)
            if not opts.is_load_enabled or not chunks:
                return 0, False
            # Unplaceable (positions unknown): an exact entry has this very antecedent, so it
            # sits at the same position; every other mode would move the chunk.
            modes = opts.modes if positions is not None else opts.modes & {EXACT}
            cids = [c.cid for c in chunks]
            if self._writer.has_pending(cids) or self._reported.has_pending(cids):
                # A save of one of these chunks is on its way to the store: ask again next step
                # rather than recompute what is about to be cached.
                return None, False
            plan = plan_request(
                chunks,
                self._view,
                num_computed_tokens=num_computed_tokens,
                num_tokens=int(request.num_tokens),
                modes=modes,
                patch_rank=opts.patch_rank or self._config.patch_rank,
                min_hole_tokens=self._min_hole_tokens,
                mode_filter=self._mode_filter,
            )
        except Exception:
            # The scheduler must survive a store or planning fault: serve nothing.
            logger.exception("OrbitKV: planning failed for request %s", request.request_id)
            self._stats.add("planning_errors", 1)
            self._plan_memo.pop(request.request_id, None)
            return 0, False
        self._plan_memo[request.request_id] = plan
        return plan.num_external_tokens, False

    # -- state ----------------------------------------------------------------------------------

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        state = self._reqs.get(req_id)
        if state is None:
            opts, chunks, positions = self._chunks(request)
            state = ReqState(req_id, chunks, opts, len(request.prompt_token_ids or ()), request)
            state.positions = positions or [c.start for c in chunks]
            if opts.role == "canonicalize":
                state.canonicalize = check_canonicalize(
                    request, chunks, self._identity.anchor_ids, self._view
                )
            self._reqs[req_id] = state
        else:
            state.reset_for_admission()
        state.num_admissions += 1
        plan = self._plan_memo.get(req_id)
        if plan is None:
            return
        state.num_local_tokens = plan.num_computed_tokens
        state.has_exact = {d.index for d in plan.decisions if d.has_exact_entry}
        if num_external_tokens != plan.num_external_tokens:
            plan = _truncate(plan, max(num_external_tokens, 0))
        state.plan = plan
        state.pending_plan = plan if plan.loads else None
        state.holes = list(plan.holes)
        keys = [
            k
            for item in (*plan.loads, *(i for h in plan.holes for i in h.loads))
            for k in (item.key, item.patch_key)
            if k
        ]
        if not keys:
            return
        self._reported.touch(keys)
        try:
            self._store.pin(keys)
            state.pinned.extend(keys)
        except Exception:
            logger.exception("OrbitKV: pinning failed; the load may miss and be recomputed")

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, OrbitKVWorkerMeta):
            self._reported.apply(meta)
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self._forget_failed_loads(set(invalid))

    def _forget_failed_loads(self, invalid: set[int]) -> None:
        """vLLM recomputes each affected request from its first invalid block: so does the ledger,
        and a hole there that was not jumped yet is dropped (its region is recomputed)."""
        for state in self._reqs.values():
            boundary = state.first_invalid_token(invalid, self._block_size)
            if boundary is None or not state.runs:
                continue
            state.forget_from(boundary)
            state.holes = [h for h in state.holes if h.start >= boundary]

    # -- the scheduler extension's hooks (holes) -------------------------------------------------

    def enable_holes(self, min_hole_tokens: int) -> None:
        self._min_hole_tokens = max(0, int(min_hole_tokens))

    @property
    def is_holes_enabled(self) -> bool:
        return self._min_hole_tokens > 0

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
            plan = self._plan_memo.get(req_id)
            holes = [h for h in (plan.holes if plan else ()) if h.start > num_computed_tokens]
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

    # -- per step -------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> OrbitKVMetadata:
        meta = OrbitKVMetadata()
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._emit_prefix_loads(state, meta)
            done = new.num_computed_tokens + num_scheduled[new.req_id]
            emit_saves(state, done, meta, self._config, self._block_size)
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
            if state.jumping is not None:
                self._emit_hole(state, state.jumping, meta)
                state.jumping = None
                # vLLM marks sync loads only for admissions; without this the worker would start
                # the hole's load after the forward that reads it.
                scheduler_output.has_sync_kv_loads = True
            end = cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0)
            emit_saves(state, end, meta, self._config, self._block_size)
        return meta

    def _emit_prefix_loads(self, state: ReqState, meta: OrbitKVMetadata) -> None:
        plan, state.pending_plan = state.pending_plan, None
        for item in plan.loads if plan is not None else ():
            self._emit_load(state, item, meta, is_hole=False)

    def _emit_hole(self, state: ReqState, hole: Hole, meta: OrbitKVMetadata) -> None:
        for item in hole.loads:
            self._emit_load(state, item, meta, is_hole=True)

    def _emit_load(
        self, state: ReqState, item: LoadItem, meta: OrbitKVMetadata, *, is_hole: bool
    ) -> None:
        decision = state.plan.decision(item.chunk_index) if state.plan is not None else None
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
            )
        )
        state.served.add(item.chunk_index)
        state.record(item.begin, item.end, item.mode, tier, is_hole=is_hole)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._chunk_memo.pop(req_id, None)
        self._plan_memo.pop(req_id, None)
        state = self._reqs.pop(req_id, None)
        if state is None:
            return False, None
        if state.pinned:
            try:
                self._store.unpin(state.pinned)
            except Exception:
                logger.exception("OrbitKV: unpin failed")
        summary = state.summary()
        for run in state.runs:
            self._stats.add(f"hit_chunks.{run.mode}", 1)
            self._stats.add(f"hit_tokens.{run.tier}", run.num_tokens)
        served = summary["num_reused_tokens"]
        local = min(state.num_local_tokens, state.num_prompt_tokens - served)
        self._stats.add("prompt_tokens.orbitkv", served)
        self._stats.add("prompt_tokens.prefix_cache", local)
        self._stats.add("prompt_tokens.computed", state.num_prompt_tokens - served - local)
        self._stats.add("hole_tokens", summary["num_hole_tokens"])
        self._stats.add("approximate_tokens", summary["num_approximate_tokens"])
        # Blocks can be freed at once: saves gathered their KV during the step.
        return False, {"orbitkv": summary}

    def take_stats(self) -> OrbitKVStats | None:
        """Counters since the last call (vLLM adds them to the worker's every step)."""
        for name, value in self._shared.take_store_faults().items():
            self._stats.add(name, value)
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, OrbitKVStats()
        return stats

    @property
    def num_tracked_requests(self) -> int:
        """Requests with state or memos here (0 once every request finished: nothing leaked)."""
        return len(set(self._reqs) | set(self._chunk_memo) | set(self._plan_memo))


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
