"""A waiting request waits for a save in flight only when it could load what is being saved.

vLLM asks ``get_num_new_matched_tokens`` again every step while the answer is ``None``; the
scheduler half answers ``None`` while a save it could serve from is still on the writer thread.
The writer is held here by a job that blocks until released, so the saves queued behind it are in
flight for as long as the test needs."""

from __future__ import annotations

import pytest
from halves_testlib import build_halves, computed_step, held_writer, release
from halves_testlib import request as _request

SYS, C1, C2, Q = [1] * 4, [2] * 4, [3] * 4, [9]


def _compute_unflushed(built, req_id, tokens, blocks, seed):
    """A request computed whole; its saves queued, not yet written."""
    req, meta = computed_step(built, req_id, tokens, blocks, seed)
    assert meta.saves, "the request saved nothing: the test would prove nothing"
    built[0].request_finished(req, blocks)


@pytest.fixture(params=["off", "all"], ids=["exact-only", "approximate"])
def built(request):
    halves = build_halves(patch_rank=0, approximate_reuse=request.param)
    yield halves
    release(halves)


def test_the_same_context_waits_for_its_save_then_loads_it(built):
    sched, _, _, shared = built
    with held_writer(shared.writer):
        _compute_unflushed(built, "a", SYS + C1 + Q, [1, 2, 3], seed=1)
        again = _request("b", SYS + C1 + Q)
        assert sched.get_num_new_matched_tokens(again, 0) == (None, False)
    shared.writer.flush()
    assert sched.get_num_new_matched_tokens(again, 0) == (8, False)


def test_chunks_in_vllms_own_prefix_hit_are_not_waited_for(built):
    sched, _, _, shared = built
    with held_writer(shared.writer):
        _compute_unflushed(built, "a", SYS + C1 + Q, [1, 2, 3], seed=1)
        again = _request("b", SYS + C1 + Q)
        # vLLM's prefix cache holds both saved chunks: nothing in flight could add to that.
        assert sched.get_num_new_matched_tokens(again, 8) == (0, False)
        assert shared.writer.has_pending([c.cid for c in sched.admissions.chunks(again)[1]])


def test_content_behind_other_chunks_is_waited_for_only_by_approximate_requests(built):
    sched, _, _, shared = built
    is_exact_only = sched._config.approximate_reuse == "off"
    with held_writer(shared.writer):
        _compute_unflushed(built, "a", SYS + C1 + C2 + Q, [1, 2, 3, 4], seed=2)
        # C2 again, behind other chunks: its exact entry (behind SYS + C1) cannot serve it.
        other = _request("b", [5] * 4 + C2 + Q)
        num, is_async = sched.get_num_new_matched_tokens(other, 0)
        assert shared.writer.has_pending([c.cid for c in sched.admissions.chunks(other)[1]])
        if is_exact_only:
            assert (num, is_async) == (0, False)
        else:
            assert (num, is_async) == (None, False)  # a survivor of C2 is on its way
    if not is_exact_only:
        shared.writer.flush()
        num, _ = sched.get_num_new_matched_tokens(other, 0)
        assert num is not None  # planned once the save landed
