"""Scheduler half: plan what each request can reuse, and tell the worker what to load and save.

vLLM calls ``get_num_new_matched_tokens`` again and again while a request waits (and again after a
preemption), so it only reads: the store through its batched lookups, and two memo tables keyed by
request id (the request's chunks, a pure function of its prompt, and the last plan, overwritten on
every call). The state a request carries into a step is created in ``update_state_after_alloc``.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from .chunking import Chunk, KeyContext, chunk_prompt, mm_spans_from_features
from .identity import ModelIdentity
from .metadata import (
    LoadSpec,
    OrbitKVMetadata,
    OrbitKVWorkerMeta,
    SaveSpec,
    blocks_for,
    slots_for,
)
from .options import RequestOptions, configured_modes, parse_options
from .planner import Plan, default_key_fn, plan_request
from .reported import ReportedIndex, SchedulerView
from .stats import OrbitKVStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _ReqState:
    req_id: str
    chunks: list[Chunk]
    options: RequestOptions
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    # Set by update_state_after_alloc, turned into LoadSpecs once the request is scheduled.
    pending_plan: Plan | None = None
    served: set[int] = field(default_factory=set)
    has_exact: set[int] = field(default_factory=set)
    # Chunks ending at or before this were computed before this request (vLLM's prefix cache).
    num_local_tokens: int = 0
    next_save: int = 0
    pinned: list[str] = field(default_factory=list)
    reused: Counter[str] = field(default_factory=Counter)
    # (block ids, mode, tokens) of each load handed to the worker, to undo on a reported failure.
    loads: list[tuple[frozenset[int], str, int]] = field(default_factory=list)
    num_failed_load_tokens: int = 0
    num_saved_chunks: int = 0


class SchedulerHalf:
    def __init__(self, vllm_config: Any, config: Any, identity: ModelIdentity, shared: Any) -> None:
        self._block_size = int(vllm_config.cache_config.block_size)
        self._config = config
        self._identity = identity
        self._store = shared.store
        self._writer = shared.writer
        budget = int(config.max_local_cpu_size * (1 << 30)) if config.local_cpu else 0
        self._reported = ReportedIndex(budget)
        self._view = SchedulerView(shared.store, self._reported)
        self._modes = configured_modes(config)
        self._reqs: dict[str, _ReqState] = {}
        self._chunk_memo: dict[str, tuple[RequestOptions, list[Chunk]]] = {}
        self._plan_memo: dict[str, Plan] = {}
        self._stats = OrbitKVStats()

    # -- planning (read-only) -----------------------------------------------------------------

    def _options(self, request: Any) -> RequestOptions:
        return parse_options(
            request.kv_transfer_params,
            default_modes=self._modes,
            default_tenant=self._config.tenant,
        )

    def _chunks(self, request: Any) -> tuple[RequestOptions, list[Chunk]]:
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
            )
        except (TypeError, ValueError):
            # A prompt the chunker cannot split (e.g. overlapping items) is simply not cached.
            logger.exception("OrbitKV: cannot chunk request %s", request.request_id)
            chunks = []
        self._chunk_memo[request.request_id] = (opts, chunks)
        return opts, chunks

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        try:
            opts, chunks = self._chunks(request)
            if not opts.is_load_enabled or not chunks:
                return 0, False
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
                modes=opts.modes,
                patch_rank=self._config.patch_rank,
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
            opts, chunks = self._chunks(request)
            state = _ReqState(req_id, chunks, opts, len(request.prompt_token_ids or ()))
            self._reqs[req_id] = state
        plan = self._plan_memo.get(req_id)
        if plan is None:
            return
        state.num_local_tokens = plan.num_computed_tokens
        state.has_exact = {d.index for d in plan.decisions if d.has_exact_entry}
        if num_external_tokens <= 0:
            state.pending_plan = None
            return
        if num_external_tokens != plan.num_external_tokens:
            plan = _truncate(plan, num_external_tokens)
        state.pending_plan = plan
        keys = [k for item in plan.loads for k in (item.key, item.patch_key) if k]
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
        """vLLM recomputes what failed to load: the summary must not count it as reused."""
        for state in self._reqs.values():
            kept = []
            for blocks, mode, num_tokens in state.loads:
                if blocks & invalid:
                    state.reused[mode] -= num_tokens
                    state.num_failed_load_tokens += num_tokens
                else:
                    kept.append((blocks, mode, num_tokens))
            state.loads = kept
            state.reused = +state.reused

    def build_connector_meta(self, scheduler_output: Any) -> OrbitKVMetadata:
        meta = OrbitKVMetadata()
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._emit_loads(state, meta)
            self._emit_saves(state, new.num_computed_tokens + num_scheduled[new.req_id], meta)
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
                self._emit_loads(state, meta)
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            end = cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0)
            self._emit_saves(state, end, meta)
        return meta

    def _emit_loads(self, state: _ReqState, meta: OrbitKVMetadata) -> None:
        plan, state.pending_plan = state.pending_plan, None
        if plan is None:
            return
        bs = self._block_size
        for item in plan.loads:
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
                )
            )
            state.served.add(item.chunk_index)
            state.reused[item.mode] += item.num_tokens
            decision = plan.decision(item.chunk_index)
            tier = (decision.tier if decision is not None else None) or "unknown"
            self._stats.add(f"hit_chunks.{item.mode}", 1)
            self._stats.add(f"hit_tokens.{tier}", item.num_tokens)
            state.loads.append((frozenset(meta.loads[-1].block_ids), item.mode, item.num_tokens))

    def _emit_saves(self, state: _ReqState, num_done: int, meta: OrbitKVMetadata) -> None:
        """Save every chunk that is complete once this step's tokens are computed."""
        if not state.options.is_save_enabled:
            return
        limit = min(num_done, state.num_prompt_tokens)
        is_canonicalize = state.options.role == "canonicalize"
        while state.next_save < len(state.chunks) and state.chunks[state.next_save].end <= limit:
            c = state.chunks[state.next_save]
            state.next_save += 1
            if (
                c.index in state.served
                or c.index in state.has_exact
                or c.end <= state.num_local_tokens
            ):
                continue
            keys = {"conditioned": default_key_fn(c.cid, "conditioned", c.antecedent_hash, 0)}
            canonical_key = default_key_fn(c.cid, "canonical", "", 0)
            patch_key = None
            if c.is_canonical_slot:
                if self._config.save_canonical or is_canonicalize:
                    keys["canonical"] = canonical_key
            elif self._config.patch_rank > 0 and not c.is_anchor:
                rank = self._config.patch_rank
                patch_key = default_key_fn(c.cid, "patch", c.antecedent_hash, rank)
            meta.saves.append(
                SaveSpec(
                    req_id=state.req_id,
                    cid=c.cid,
                    start=c.start,
                    slots=slots_for(state.block_ids, self._block_size, c.start, c.end),
                    antecedent=c.antecedent,
                    antecedent_hash=c.antecedent_hash,
                    keys=keys,
                    patch_key=patch_key,
                    canonical_key=canonical_key if patch_key else None,
                )
            )
            state.num_saved_chunks += 1

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
        summary = {
            "num_prompt_tokens": state.num_prompt_tokens,
            "num_chunks": len(state.chunks),
            "num_reused_tokens": sum(state.reused.values()),
            "reused_tokens_by_mode": dict(state.reused),
            "num_failed_load_tokens": state.num_failed_load_tokens,
            "num_saved_chunks": state.num_saved_chunks,
        }
        served = summary["num_reused_tokens"]
        local = min(state.num_local_tokens, state.num_prompt_tokens - served)
        self._stats.add("prompt_tokens.orbitkv", served)
        self._stats.add("prompt_tokens.prefix_cache", local)
        self._stats.add("prompt_tokens.computed", state.num_prompt_tokens - served - local)
        # Blocks can be freed at once: saves gathered their KV during the step.
        return False, {"orbitkv": summary}

    def take_stats(self) -> OrbitKVStats | None:
        """Counters since the last call (vLLM adds them to the worker's every step)."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, OrbitKVStats()
        return stats

    @property
    def num_tracked_requests(self) -> int:
        """Requests with state or memos here (0 once every request finished: nothing leaked)."""
        return len(set(self._reqs) | set(self._chunk_memo) | set(self._plan_memo))


def _truncate(plan: Plan, num_tokens: int) -> Plan:
    """The plan cut to its first ``num_tokens`` served tokens (vLLM may accept fewer)."""
    loads = []
    left = num_tokens
    for item in plan.loads:
        if left <= 0:
            break
        n = min(left, item.num_tokens)
        loads.append(item if n == item.num_tokens else _shorten(item, n))
        left -= n
    return Plan(plan.num_computed_tokens, num_tokens - max(left, 0), tuple(loads), plan.decisions)


def _shorten(item: Any, n: int) -> Any:
    return replace(item, end=item.begin + n)
