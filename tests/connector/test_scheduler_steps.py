"""Holes, failures and preemption step by step in vLLM's real scheduler (sync and async
classes), no model (``scheduler_testlib.py``): a 64-token step budget, chunks that are not blocks,
a load failure in the step that jumps a hole, a preemption, and the async scheduler's step that
runs ahead of the previous one's output. In every case the ledger (the request's summary) and
vLLM's own prefill stats agree, and nothing is left tracked."""

from __future__ import annotations

import pytest
from scheduler_testlib import SchedulerRig

BS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")


def _tokens(seed: int, n: int) -> list[int]:
    return [10 + (seed * 53 + 7 * i) % 900 for i in range(n)]


def _assert_ledger_agrees(rig: SchedulerRig, req_id: str, num_prompt_tokens: int) -> dict:
    summary = rig.summary(req_id)
    stats = rig.prefill_stats(req_id)
    assert stats.num_external_cached_tokens == summary["num_reused_tokens"], (summary, stats)
    assert stats.num_local_cached_tokens == summary["num_prefix_cache_tokens"], (summary, stats)
    assert stats.num_computed_tokens == (
        num_prompt_tokens - summary["num_reused_tokens"] - summary["num_prefix_cache_tokens"]
    )
    return summary


def _run_async(rig: SchedulerRig, max_steps: int = 100, failures: dict[int, set[int]] | None = None):
    """The async engine's loop: step n+1 is scheduled before step n's output is processed."""
    in_flight = None
    for n in range(max_steps):
        out = rig.schedule() if rig.scheduler.has_requests() else None
        if in_flight is not None:
            rig.finish(in_flight[1], failed_blocks=(failures or {}).get(in_flight[0]))
        in_flight = (n, out) if out is not None else None
        if in_flight is None and not rig.scheduler.has_requests():
            return
    raise AssertionError("requests still unfinished")


def test_a_hole_load_failing_in_its_jump_step_is_recomputed_and_accounted(model_dir):
    """[fresh, fresh, hole(2 chunks), fresh, hole, q] under a 64-token budget: the first hole's
    load fails in the step that jumps it; vLLM recomputes from its first block, the second hole
    is still served, and summary, ledger and vLLM's stats agree."""
    rig = SchedulerRig(model_dir, max_num_batched_tokens=64)
    try:
        prompt = _tokens(1, 6 * BS + 5)
        rig.store_chunks(prompt, [2, 3, 5])
        rig.half.enable_holes(16)
        rig.add("r", prompt)
        first = rig.step()
        assert first.num_scheduled_tokens["r"] == 2 * BS  # capped at the first hole
        jump = rig.schedule()
        loads = jump.kv_connector_metadata.loads
        assert [(s.chunk_start, len(s.slots)) for s in loads] == [(2 * BS, BS), (3 * BS, BS)]
        assert jump.has_sync_kv_loads
        blocks = rig.block_ids("r")
        rig.finish(jump, failed_blocks={blocks[2]})
        assert rig.scheduler.requests["r"].num_computed_tokens == 2 * BS
        assert not rig.is_cached(blocks[2]) and not rig.is_cached(blocks[3])
        rig.run_until_done()
        summary = _assert_ledger_agrees(rig, "r", len(prompt))
        assert summary["num_hole_tokens"] == BS  # the second hole
        assert summary["num_failed_load_tokens"] == 2 * BS
        assert rig.half.num_tracked_requests == 0
    finally:
        rig.close()


def test_chunks_that_are_not_blocks(model_dir):
    """24-token chunks over 16-token blocks: a hole starts and ends inside blocks; its load is
    emitted with the slots of exactly its tokens, and a failure restarts at its block's start."""
    rig = SchedulerRig(model_dir, chunk_size=24, max_num_batched_tokens=64)
    try:
        prompt = _tokens(2, 4 * 24 + 3)
        rig.store_chunks(prompt, [2])  # tokens [48, 72): blocks 3 and 4
        rig.half.enable_holes(16)
        rig.add("r", prompt)
        rig.step()
        jump = rig.schedule()
        (load,) = jump.kv_connector_metadata.loads
        blocks = rig.block_ids("r")
        assert load.chunk_start == 48 and load.first_block_token == 48
        assert list(load.slots) == [blocks[p // BS] * BS + p % BS for p in range(48, 72)]
        rig.finish(jump, failed_blocks={blocks[3]})
        assert rig.scheduler.requests["r"].num_computed_tokens == 48
        rig.run_until_done()
        _assert_ledger_agrees(rig, "r", len(prompt))
    finally:
        rig.close()


def test_preemption_replans_and_the_reported_prefill_is_vllms(model_dir):
    """Too few blocks for two requests: one is preempted and admitted again, planned afresh; what
    it reports is the admission vLLM reported, and nothing stays pinned or tracked."""
    rig = SchedulerRig(model_dir, num_blocks=12, max_num_batched_tokens=64)
    try:
        # Both prompts fit (3 blocks each of 11); their decodes (6 blocks each) do not.
        a, b = _tokens(3, 2 * BS + 2), _tokens(4, 2 * BS + 2)
        rig.store_chunks(a)
        rig.store_chunks(b, [0])
        rig.add("a", a, max_tokens=60)
        rig.add("b", b, max_tokens=60)
        rig.run_until_done(max_steps=400)
        assert sum(rig.num_preemptions.values()) >= 1, rig.num_preemptions
        for req_id, prompt in (("a", a), ("b", b)):
            _assert_ledger_agrees(rig, req_id, len(prompt))
        assert rig.half.num_tracked_requests == 0
        assert not any(rig.store.pin_count(k) for k in rig.store_chunks(a))
    finally:
        rig.close()


def test_the_async_scheduler_jumps_a_hole_in_the_step_that_runs_ahead(model_dir):
    """The async class (vLLM's CPU build forces async off, so only this runs it): step 2 is
    scheduled before step 1's output; step 2 jumps the hole and loads it before its forward."""
    rig = SchedulerRig(model_dir, is_async=True, max_num_batched_tokens=64)
    try:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        assert isinstance(rig.scheduler, AsyncScheduler)
        prompt = _tokens(5, 4 * BS + 5)
        rig.store_chunks(prompt, [2])
        rig.half.enable_holes(16)
        rig.add("r", prompt)
        first = rig.schedule()
        assert first.num_scheduled_tokens["r"] == 2 * BS
        ahead = rig.schedule()  # before step 1's output, as the async engine does
        (load,) = ahead.kv_connector_metadata.loads
        assert load.chunk_start == 2 * BS and ahead.has_sync_kv_loads
        blocks = rig.block_ids("r")
        assert list(load.slots) == [blocks[p // BS] * BS + p % BS for p in range(2 * BS, 3 * BS)]
        assert ahead.num_scheduled_tokens["r"] == len(prompt) - 3 * BS
        assert rig.local_hit("probe", prompt) <= 2 * BS  # the hole is not readable yet
        rig.finish(first)
        rig.finish(ahead)
        _run_async(rig)
        summary = _assert_ledger_agrees(rig, "r", len(prompt))
        assert summary["num_hole_tokens"] == BS
    finally:
        rig.close()


def test_the_async_scheduler_recovers_from_a_failure_in_the_step_that_ran_ahead(model_dir):
    """A hole's load fails in step 2, whose output is processed after step 3 was scheduled; the
    blocks step 3 computed over it are not readable meanwhile and leave the cache with it."""
    rig = SchedulerRig(model_dir, is_async=True, max_num_batched_tokens=32)
    try:
        prompt = _tokens(6, 6 * BS + 5)
        rig.store_chunks(prompt, [2])
        rig.half.enable_holes(16)
        rig.add("r", prompt)
        step1 = rig.schedule()
        step2 = rig.schedule()  # jumps the hole (tokens 32..48) and computes 48..80
        assert step2.kv_connector_metadata.loads
        rig.finish(step1)
        step3 = rig.schedule()  # runs ahead of step 2's output
        blocks = rig.block_ids("r")
        assert rig.local_hit("probe", prompt) <= 2 * BS
        rig.finish(step2, failed_blocks={blocks[2]})
        assert not any(rig.is_cached(b) for b in blocks[2:])
        rig.finish(step3)
        _run_async(rig)
        summary = _assert_ledger_agrees(rig, "r", len(prompt))
        assert summary["num_reused_tokens"] == 0
        assert rig.half.num_tracked_requests == 0
    finally:
        rig.close()
