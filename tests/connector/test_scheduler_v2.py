"""Holes and failed loads under vLLM's GPU model runner V2, on the CPU: the scheduler extension's
real output (vLLM's scheduler built for V2, no model: ``scheduler_testlib.py``) stepped through
V2's own request-state code and input kernels (``v2_runner_testlib.py``).

V2 keeps each request's computed count on the device; it takes a count from the scheduler only
for a new request and otherwise moves it by the tokens each step ran. A jumped request is
therefore re-sent as a new request (``carry_as_new``), and so is a request vLLM truncated after a
failed load. The checks: at every step the count V2 reads equals vLLM's scheduler's, the jump
step's positions, input ids and KV slots start at the hole's end, and without the carry V2 would
run the hole's tokens again (the control)."""

from __future__ import annotations

import logging

import pytest
from scheduler_testlib import SchedulerRig
from v2_runner_testlib import V2Runner

BS = 16
V2_HOLES = {"orbitkv_enable_v2_holes": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")


def _tokens(seed: int, n: int) -> list[int]:
    return [10 + (seed * 53 + 7 * i) % 900 for i in range(n)]


def _scheduled_counts(out) -> dict[str, int]:
    counts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    counts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return counts


def _run(rig: SchedulerRig, v2: V2Runner, out, *, is_checked: bool = True) -> dict:
    """V2 steps ``out``; its count for every request agrees with vLLM's scheduler's."""
    ran = v2.execute(out)
    if is_checked:
        assert {r: step["num_computed"] for r, step in ran.items()} == _scheduled_counts(out)
        for req_id, step in ran.items():
            start = step["num_computed"]
            assert step["positions"] == list(range(start, start + out.num_scheduled_tokens[req_id]))
    return ran


def _run_until_done(rig: SchedulerRig, v2: V2Runner, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        if not rig.scheduler.has_requests():
            return
        out = rig.schedule()
        _run(rig, v2, out)
        rig.finish(out)
    raise AssertionError("requests still unfinished")


def _run_async_until_done(rig: SchedulerRig, v2: V2Runner, max_steps: int = 100) -> None:
    """The async engine's loop: step n+1 is scheduled (and run by V2) before step n's output."""
    in_flight = None
    for _ in range(max_steps):
        out = rig.schedule() if rig.scheduler.has_requests() else None
        if out is not None:
            _run(rig, v2, out)
        if in_flight is not None:
            rig.finish(in_flight)
        in_flight = out
        if in_flight is None and not rig.scheduler.has_requests():
            return
    raise AssertionError("requests still unfinished")


def _slots(rig: SchedulerRig, req_id: str, begin: int, end: int) -> list[int]:
    blocks = rig.block_ids(req_id)
    return [blocks[p // BS] * BS + p % BS for p in range(begin, end)]


def test_v2_reads_the_jump_and_computes_after_the_hole(model_dir, monkeypatch):
    """[fresh, fresh, hole, fresh, q] beside a plain prefill: the jump step re-sends the jumped
    request as new (whole block list, hole's end); V2 stages that count, runs the tokens after the
    hole at their positions into their slots, and the other request's state is untouched."""
    rig = SchedulerRig(model_dir, is_v2=True, max_num_batched_tokens=64, extra_config=V2_HOLES)
    try:
        v2 = V2Runner(rig.vllm_config, rig.kv_cache_config, monkeypatch)
        prompt, other = _tokens(1, 4 * BS + 5), _tokens(2, 20)
        rig.store_chunks(prompt, [2])
        rig.add("r", prompt)
        rig.add("a", other, max_tokens=8)
        first = rig.schedule()
        assert first.num_scheduled_tokens["r"] == 2 * BS  # capped at the hole
        _run(rig, v2, first)
        rig.finish(first)
        jump = rig.schedule()
        (new,) = jump.scheduled_new_reqs
        assert new.req_id == "r" and "r" not in jump.scheduled_cached_reqs.req_ids
        assert new.num_computed_tokens == 3 * BS
        assert list(new.block_ids[0]) == rig.block_ids("r") and new.prefill_token_ids == prompt
        assert jump.scheduled_cached_reqs.req_ids == ["a"]  # decoding beside it
        (load,) = jump.kv_connector_metadata.loads
        assert jump.has_sync_kv_loads and list(load.slots) == _slots(rig, "r", 2 * BS, 3 * BS)
        ran = _run(rig, v2, jump)
        num = jump.num_scheduled_tokens["r"]
        assert ran["r"]["num_computed"] == 3 * BS
        assert ran["r"]["input_ids"] == prompt[3 * BS : 3 * BS + num]
        assert ran["r"]["seq_len"] == 3 * BS + num
        assert ran["r"]["slots"] == _slots(rig, "r", 3 * BS, 3 * BS + num)
        assert ran["a"]["num_computed"] == len(other)
        rig.finish(jump)
        assert v2.num_computed_tokens("r") == rig.scheduler.requests["r"].num_computed_tokens
        _run_until_done(rig, v2)
        assert rig.summary("r")["num_hole_tokens"] == BS
        assert rig.half.num_tracked_requests == 0
    finally:
        rig.close()


def test_without_the_carry_v2_would_run_the_hole_again(model_dir, monkeypatch):
    """The control: a jumped request left among the cached requests, as before this change. V2
    keeps its own count (the hole's start), so the step would run the hole's tokens, the very
    slots being loaded, and stop short of the prompt's end."""
    from orbitkv.connector.vllm_ext import hole_scheduler

    monkeypatch.setattr(hole_scheduler, "carry_as_new", lambda *args, **kwargs: [])
    rig = SchedulerRig(model_dir, is_v2=True, max_num_batched_tokens=64, extra_config=V2_HOLES)
    try:
        v2 = V2Runner(rig.vllm_config, rig.kv_cache_config, monkeypatch)
        prompt = _tokens(3, 4 * BS + 5)
        rig.store_chunks(prompt, [2])
        rig.add("r", prompt)
        first = rig.schedule()
        _run(rig, v2, first)
        rig.finish(first)
        jump = rig.schedule()
        assert jump.kv_connector_metadata.loads and "r" in jump.scheduled_cached_reqs.req_ids
        assert _scheduled_counts(jump)["r"] == 3 * BS
        ran = _run(rig, v2, jump, is_checked=False)["r"]
        num = jump.num_scheduled_tokens["r"]
        assert ran["num_computed"] == 2 * BS
        assert ran["positions"][0] == 2 * BS
        assert ran["input_ids"] == prompt[2 * BS : 2 * BS + num]
        assert ran["slots"][:BS] == _slots(rig, "r", 2 * BS, 3 * BS)
    finally:
        rig.close()


def test_v1_keeps_the_jumped_request_among_the_cached(model_dir):
    """V1 reads every running request's count from the scheduler: nothing is re-sent."""
    rig = SchedulerRig(model_dir, max_num_batched_tokens=64)
    try:
        prompt = _tokens(4, 4 * BS + 5)
        rig.store_chunks(prompt, [2])
        rig.half.enable_holes(16)
        rig.add("r", prompt)
        rig.step()
        jump = rig.schedule()
        assert not jump.scheduled_new_reqs and jump.scheduled_cached_reqs.req_ids == ["r"]
        assert jump.scheduled_cached_reqs.num_computed_tokens == [3 * BS]
        assert jump.kv_connector_metadata.loads and jump.has_sync_kv_loads
    finally:
        rig.close()


def test_v2_async_jump_in_the_step_that_runs_ahead(model_dir, monkeypatch):
    """Async scheduling: the jump step is scheduled before the previous step's output; V2 runs
    the two in order and reads the jump from the second."""
    rig = SchedulerRig(
        model_dir, is_async=True, is_v2=True, max_num_batched_tokens=64, extra_config=V2_HOLES
    )
    try:
        v2 = V2Runner(rig.vllm_config, rig.kv_cache_config, monkeypatch)
        prompt = _tokens(5, 4 * BS + 5)
        rig.store_chunks(prompt, [2])
        rig.add("r", prompt)
        first = rig.schedule()
        ahead = rig.schedule()
        assert [new.req_id for new in ahead.scheduled_new_reqs] == ["r"]
        assert ahead.kv_connector_metadata.loads and ahead.has_sync_kv_loads
        _run(rig, v2, first)
        ran = _run(rig, v2, ahead)["r"]
        assert ran["num_computed"] == 3 * BS
        assert ran["input_ids"] == prompt[3 * BS :]
        assert v2.num_computed_tokens("r") == len(prompt)
        rig.finish(first)
        _run_async_until_done(rig, v2)  # finishes the step ahead after the next is scheduled
        assert rig.summary("r")["num_hole_tokens"] == BS
        assert rig.half.num_tracked_requests == 0
    finally:
        rig.close()


@pytest.mark.parametrize("is_carried", [True, False])
def test_v2_recomputes_from_a_failed_prefix_run_load(model_dir, monkeypatch, is_carried):
    """A prefix run's second block fails to load: vLLM restarts the request at that block, but
    V2 moves a running request's count only forward (vLLM issue #49250). Re-sent as new, V2
    recomputes from the block; left among the cached (the control), it would run past the prompt
    and never recompute it."""
    from orbitkv.connector.vllm_ext import hole_scheduler

    if not is_carried:
        monkeypatch.setattr(hole_scheduler, "carry_as_new", lambda *args, **kwargs: [])
    rig = SchedulerRig(model_dir, is_v2=True, extra_config={"orbitkv_min_hole_tokens": 0})
    try:
        v2 = V2Runner(rig.vllm_config, rig.kv_cache_config, monkeypatch)
        prompt = _tokens(6, 2 * BS + 5)
        rig.store_chunks(prompt, [0, 1])
        rig.add("r", prompt)
        admit = rig.schedule()
        assert admit.kv_connector_metadata.loads
        assert _run(rig, v2, admit)["r"]["num_computed"] == 2 * BS
        rig.finish(admit, failed_blocks={rig.block_ids("r")[1]})
        assert rig.scheduler.requests["r"].num_computed_tokens == BS
        again = rig.schedule()
        ran = _run(rig, v2, again, is_checked=is_carried)["r"]
        if not is_carried:
            assert ran["num_computed"] == len(prompt) and ran["positions"][0] == len(prompt)
            return
        assert [new.req_id for new in again.scheduled_new_reqs] == ["r"]
        assert not again.kv_connector_metadata.loads  # nothing loaded twice
        assert ran["num_computed"] == BS and ran["input_ids"] == prompt[BS:]
        rig.finish(again)
        _run_until_done(rig, v2)
        summary = rig.summary("r")
        assert summary["num_reused_tokens"] == BS and summary["num_failed_load_tokens"] == BS
        assert rig.prefill_stats("r").num_external_cached_tokens == BS
        assert rig.half.num_tracked_requests == 0
    finally:
        rig.close()


def test_v2_recomputes_from_a_hole_whose_load_failed(model_dir, monkeypatch):
    """The hole's load fails in the step that jumped it: vLLM restarts the request at the hole's
    first block, and V2, handed the request as new once more, recomputes from there."""
    rig = SchedulerRig(model_dir, is_v2=True, max_num_batched_tokens=64, extra_config=V2_HOLES)
    try:
        v2 = V2Runner(rig.vllm_config, rig.kv_cache_config, monkeypatch)
        prompt = _tokens(7, 4 * BS + 5)
        rig.store_chunks(prompt, [2])
        rig.add("r", prompt)
        first = rig.schedule()
        _run(rig, v2, first)
        rig.finish(first)
        jump = rig.schedule()
        _run(rig, v2, jump)
        rig.finish(jump, failed_blocks={rig.block_ids("r")[2]})
        assert rig.scheduler.requests["r"].num_computed_tokens == 2 * BS
        again = rig.schedule()
        assert [new.req_id for new in again.scheduled_new_reqs] == ["r"]
        ran = _run(rig, v2, again)["r"]
        assert ran["num_computed"] == 2 * BS and ran["input_ids"][0] == prompt[2 * BS]
        rig.finish(again)
        _run_until_done(rig, v2)
        summary = rig.summary("r")
        assert summary["num_hole_tokens"] == 0 and summary["num_failed_load_tokens"] == BS
        assert rig.prefill_stats("r").num_external_cached_tokens == 0
        assert rig.half.num_tracked_requests == 0
    finally:
        rig.close()


def test_v2_async_recovers_from_a_failure_in_the_step_that_ran_ahead(model_dir, monkeypatch):
    """Async scheduling: the hole's load fails in step 2, whose output is processed after step 3
    was scheduled and run (over the failed hole); step 4 hands V2 the request at the hole's start
    and every later step's count agrees with the scheduler's."""
    rig = SchedulerRig(
        model_dir, is_async=True, is_v2=True, max_num_batched_tokens=32, extra_config=V2_HOLES
    )
    try:
        v2 = V2Runner(rig.vllm_config, rig.kv_cache_config, monkeypatch)
        prompt = _tokens(9, 6 * BS + 5)
        rig.store_chunks(prompt, [2])
        rig.add("r", prompt)
        step1 = rig.schedule()
        _run(rig, v2, step1)
        step2 = rig.schedule()  # jumps the hole (tokens 32..48) and computes 48..80
        assert step2.kv_connector_metadata.loads
        _run(rig, v2, step2)
        rig.finish(step1)
        step3 = rig.schedule()  # runs ahead of step 2's output
        _run(rig, v2, step3)
        rig.finish(step2, failed_blocks={rig.block_ids("r")[2]})
        step4 = rig.schedule()
        assert [new.req_id for new in step4.scheduled_new_reqs] == ["r"]
        assert _run(rig, v2, step4)["r"]["num_computed"] == 2 * BS
        rig.finish(step3)
        _run_async_until_done(rig, v2)
        assert rig.summary("r")["num_reused_tokens"] == 0
        assert rig.half.num_tracked_requests == 0
    finally:
        rig.close()


def test_v2_preemption_and_holes(model_dir, monkeypatch):
    """Too few blocks for two requests with holes: vLLM preempts one and resumes it as a new
    request (its own V2 path), holes are jumped before and after, and V2's count agrees with the
    scheduler's at every step; both ledgers agree with vLLM's prefill stats."""
    rig = SchedulerRig(
        model_dir, is_v2=True, num_blocks=14, max_num_batched_tokens=32, extra_config=V2_HOLES
    )
    try:
        v2 = V2Runner(rig.vllm_config, rig.kv_cache_config, monkeypatch)
        a, b = _tokens(10, 4 * BS + 2), _tokens(11, 4 * BS + 2)
        rig.store_chunks(a, [2])
        rig.store_chunks(b, [2])
        rig.add("a", a, max_tokens=40)
        rig.add("b", b, max_tokens=40)
        _run_until_done(rig, v2, max_steps=400)
        assert sum(rig.num_preemptions.values()) >= 1, rig.num_preemptions
        assert sum(rig.summary(r)["num_hole_tokens"] for r in ("a", "b")) >= BS  # jumped
        for req_id, prompt in (("a", a), ("b", b)):
            summary = rig.summary(req_id)
            stats = rig.prefill_stats(req_id)
            assert stats.num_external_cached_tokens == summary["num_reused_tokens"]
            assert stats.num_computed_tokens == len(prompt) - summary["num_reused_tokens"]
        assert rig.half.num_tracked_requests == 0
    finally:
        rig.close()


def test_v2_without_the_knob_refuses_holes_loudly_and_keeps_prefix_runs(model_dir, caplog):
    """V2 set by hand without ``enable_v2_holes``: holes are refused with a warning that names
    VLLM_USE_V2_MODEL_RUNNER and the knob; the prefix run is still served."""
    with caplog.at_level(logging.WARNING, logger="orbitkv.connector.vllm_ext.hole_scheduler"):
        rig = SchedulerRig(model_dir, is_v2=True)
    try:
        (record,) = [r for r in caplog.records if "holes are off" in r.getMessage()]
        assert record.levelno == logging.WARNING
        assert "VLLM_USE_V2_MODEL_RUNNER" in record.getMessage()
        assert "enable_v2_holes" in record.getMessage()
        assert not rig.half.is_holes_enabled
        prompt = _tokens(8, 4 * BS + 5)
        rig.store_chunks(prompt, [0, 2])  # a prefix run and a would-be hole
        rig.add("r", prompt)
        rig.run_until_done()
        summary = rig.summary("r")
        assert summary["num_reused_tokens"] == BS and summary["num_hole_tokens"] == 0
    finally:
        rig.close()
