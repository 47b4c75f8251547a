"""The scheduler extension's exactness duties: what vLLM's prefix cache may hand out.

vLLM caches a block under its hash as soon as it is allocated, before the forward that fills it;
that is safe for blocks vLLM computes, not for blocks a connector loads, whose load can still fail.
So, in OrbitKV's scheduler (``hole_scheduler.py``):

- **lookup by lineage**: a request under an approximate policy looks its prefix up along the chain
  that takes exact blocks as far as they go, then its policy's approximate blocks
  (``prefix_lineage.py``); the half learns where the hit stops being exact;
- **loaded blocks wait for confirmation**: a block a step loads, and every block its request
  computes after it, is cut from other requests' prefix hits from the moment vLLM allocates it
  (a later admission in the same step must not share it) until vLLM has processed that step's
  output (with async scheduling, the next step is scheduled before that);
- **failed loads leave the cache**: each affected request is truncated at its own first invalid
  block (vLLM truncates only the first of two requests sharing one, and lets the other read it),
  the blocks from there leave vLLM's prefix cache at once under the ``recompute`` policy too, and
  the half is told where each request restarts (ledger, saves, holes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from ..scheduler.half import SchedulerHalf

logger = logging.getLogger(__name__)


def load_refusal(kv_cache_config: KVCacheConfig) -> str | None:
    """Why OrbitKV must not load on this engine, or None."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) != 1:
        # vLLM cannot map a failed block back to requests with several groups (it raises).
        return f"the model has {len(groups)} KV cache groups (hybrid attention)"
    return None


@dataclass(slots=True)
class _Pending:
    """A request with loads not confirmed yet: its blocks from ``first_block`` on."""

    first_block: int
    last_step: int
    block_ids: set[int] = field(default_factory=set)


class ExactGuard:
    def __init__(self, scheduler: Scheduler, half: SchedulerHalf, block_size: int) -> None:
        self._scheduler = scheduler
        self._half = half
        self._block_size = block_size
        self._pending: dict[str, _Pending] = {}
        self._steps: dict[int, int] = {}
        self._num_steps = 0

    @property
    def _manager(self) -> Any:
        return self._scheduler.kv_cache_manager

    # -- lookup ------------------------------------------------------------------------------------

    def before_lookup(self, request: Request) -> int | None:
        """Show vLLM the block chain this request's lookup should follow; returns the block where
        that chain switches from exact to approximate blocks (None: an exact lookup)."""
        hasher = self._half.admissions.hasher(request.request_id)
        if hasher is None:
            return None
        if not hasher.is_approximate_allowed or request.skip_reading_prefix_cache:
            return None
        pool = self._manager.block_pool
        max_blocks = (request.num_tokens - 1) // self._block_size
        switch, _ = hasher.best_switch(
            lambda h: pool.get_cached_block(h, [0]) is not None, max_blocks
        )
        hasher.show(request, switch)
        return switch

    def after_lookup(
        self, request: Request, hit: tuple[Any, int, int, bool], switch: int | None
    ) -> tuple[tuple[Any, int, int, bool], int | None]:
        """vLLM's prefix hit cut before blocks whose load is not confirmed, and the first token
        of it that came from approximate blocks (None: the hit is exact). ``switch`` is what
        ``before_lookup`` returned."""
        blocks, num_local, boundary, diverged = hit
        unconfirmed = self.unconfirmed_blocks()
        if unconfirmed and num_local:
            ids = [b.block_id for b in blocks.blocks[0]]
            cut = next((i for i, block_id in enumerate(ids) if block_id in unconfirmed), None)
            if cut is not None:
                num_local = cut * self._block_size
                blocks = self._manager.truncate_computed_blocks(blocks, num_local)
                boundary = min(boundary, num_local)
        approx_from = None
        if switch is not None:
            start = switch * self._block_size
            approx_from = start if num_local > start else None
        return (blocks, num_local, boundary, diverged), approx_from

    def unconfirmed_blocks(self) -> set[int]:
        out: set[int] = set()
        for req_id, pending in self._pending.items():
            out |= pending.block_ids
            out.update(self._block_ids(req_id)[pending.first_block :])
        return out

    # -- steps -------------------------------------------------------------------------------------

    def begin_load(self, req_id: str, first_token: int) -> None:
        """A load into this request's blocks from ``first_token`` on, in the step being built."""
        first_block = first_token // self._block_size
        step = self._num_steps + 1
        pending = self._pending.get(req_id)
        if pending is None:
            self._pending[req_id] = _Pending(first_block, step)
        else:
            pending.first_block = min(pending.first_block, first_block)
            pending.last_step = step

    def register_step(self, scheduler_output: SchedulerOutput) -> None:
        """After a step is built: remember which blocks await its confirmation (the request may
        be preempted or finish before that, and its blocks stay cached)."""
        self._num_steps += 1
        self._steps[id(scheduler_output)] = self._num_steps
        for req_id, pending in self._pending.items():
            pending.block_ids.update(self._block_ids(req_id)[pending.first_block :])

    def confirm(self, scheduler_output: SchedulerOutput) -> None:
        """vLLM processed this step's output (failed loads included): its loads are settled."""
        step = self._steps.pop(id(scheduler_output), None)
        if step is None:
            return
        for req_id in [r for r, p in self._pending.items() if p.last_step <= step]:
            del self._pending[req_id]

    def _block_ids(self, req_id: str) -> list[int]:
        try:
            groups = self._manager.get_block_ids(req_id)
        except (KeyError, IndexError):
            return []
        return list(groups[0]) if groups else []

    # -- failed loads ------------------------------------------------------------------------------

    def on_recomputed(self, affected: list[tuple[Any, int]], blocks_to_evict: set[int]) -> None:
        """``affected``: each request vLLM truncated and where it restarts."""
        if blocks_to_evict:
            self._manager.evict_blocks(blocks_to_evict)
        for request, _ in affected:
            self._half.on_recompute(request.request_id, int(request.num_computed_tokens))
            logger.info(
                "OrbitKV: request %s recomputes from token %d (a load failed)",
                request.request_id, request.num_computed_tokens,
            )
