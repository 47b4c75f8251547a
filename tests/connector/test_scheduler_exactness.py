"""Exact stays exact in vLLM's prefix cache: vLLM's real scheduler (OrbitKV's class) step by
step, no model (``scheduler_testlib.py``). Each test puts a load, a failure or a lineage in the
step it wants, and checks what another request can then read from vLLM's prefix cache and what
the ledger and vLLM's own prefill stats say."""

from __future__ import annotations

import pytest
from scheduler_testlib import SchedulerRig

BS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")


@pytest.fixture
def rig(model_dir):
    rig = SchedulerRig(model_dir, extra_config={"orbitkv_min_hole_tokens": 0})
    yield rig
    rig.close()


def _prompt(seed: int, num_blocks: int, tail: int = 5) -> list[int]:
    return [10 + (seed * 37 + i) % 900 for i in range(num_blocks * BS + tail)]


def test_loaded_blocks_wait_for_the_step_to_be_confirmed(rig):
    """Two requests for one stored prompt in one step: the second must not read the blocks the
    first is loading (the load can still fail); once the step is confirmed, a third may."""
    prompt = _prompt(1, 3)
    rig.store_chunks(prompt)
    rig.add("a", prompt)
    rig.add("b", prompt)
    out = rig.schedule()
    loads = out.kv_connector_metadata.loads
    assert {s.req_id for s in loads} == {"a", "b"}  # b loads its own copy, no shared blocks
    a_blocks, b_blocks = rig.block_ids("a"), rig.block_ids("b")
    assert not set(a_blocks) & set(b_blocks)
    assert rig.local_hit("probe1", prompt) == 0  # still unconfirmed
    rig.finish(out)
    assert rig.local_hit("probe2", prompt) == 3 * BS


def test_without_the_guard_the_second_request_reads_unconfirmed_blocks(rig):
    """The control: vLLM's own lookup shares the first request's loaded blocks at once."""
    prompt = _prompt(2, 3)
    rig.store_chunks(prompt)
    rig.scheduler._guard = None
    rig.add("a", prompt)
    rig.add("b", prompt)
    rig.schedule()
    assert set(rig.block_ids("a")[:3]) & set(rig.block_ids("b"))


def test_a_failed_load_leaves_the_prefix_cache_at_once(rig):
    """The load of the second chunk fails: vLLM recomputes the request from that block, the
    block and every block after it leave the prefix cache (under the recompute policy too), the
    ledger and vLLM's prefill stats agree, and a later request reads none of them."""
    prompt = _prompt(3, 3)
    rig.store_chunks(prompt)
    rig.add("a", prompt)
    out = rig.schedule()
    blocks = rig.block_ids("a")
    failed = {blocks[1]}
    rig.finish(out, failed_blocks=failed)
    request = rig.scheduler.requests["a"]
    assert request.num_computed_tokens == BS  # restarts at its first invalid block
    assert rig.is_cached(blocks[0]) and not any(rig.is_cached(b) for b in blocks[1:])
    assert rig.local_hit("probe", prompt) == BS
    rig.run_until_done()
    summary = rig.summary("a")
    stats = rig.prefill_stats("a")
    # Served: chunk 0; recomputed: everything loaded from the failed block on (to the last
    # prompt token, which vLLM always computes).
    assert summary["num_reused_tokens"] == BS
    assert summary["num_failed_load_tokens"] == len(prompt) - 1 - BS
    assert stats.num_external_cached_tokens == summary["num_reused_tokens"]
    assert stats.num_computed_tokens == len(prompt) - BS
    # The recomputed blocks are exact again: a later request is served exactly, from the store.
    assert rig.half.num_tracked_requests == 0


def test_a_shared_invalid_block_truncates_every_request_holding_it(rig):
    """vLLM truncates only the first of two requests sharing an invalid block and lets the
    second keep it as computed; OrbitKV's scheduler truncates each at its own first one."""
    prompt = _prompt(4, 4)
    rig.add("a", prompt, max_tokens=8)
    rig.step()
    rig.step()  # a's prompt computed (budget 64 per step): blocks cached and confirmed
    rig.add("b", prompt, max_tokens=8)
    out = rig.schedule()
    shared = rig.block_ids("a")[1]
    assert shared in rig.block_ids("b")
    rig.finish(out, failed_blocks={shared})
    assert rig.scheduler.requests["a"].num_computed_tokens == BS
    assert rig.scheduler.requests["b"].num_computed_tokens == BS


def test_exact_requests_never_find_approximate_blocks(model_dir):
    """Survivor KV loaded for a request that opted in: its blocks from the survivor on hash under
    its policy. The same prompt asked exact-only, with loads off, or in the same salted session
    without opting in (a salt isolates, it does not opt in), finds only the exact blocks in vLLM's
    cache; the same policy finds them all, and is told where they stop being exact."""
    rig = SchedulerRig(model_dir, extra_config={"orbitkv_approximate_reuse": "request",
                                                "orbitkv_require_calibration": False})
    try:
        sys_, c1, c2 = _prompt(5, 1, 0), _prompt(6, 1, 0), _prompt(7, 1, 0)
        q = _prompt(8, 0, 5)
        salt = {"cache_salt": "agent"}
        rig.store_chunks(sys_ + c1 + c2 + q, **salt)
        prompt = sys_ + c2 + q
        opted = {"params": {"orbitkv": {"approximate": True}}, **salt}
        rig.add("approx", prompt, **opted)
        rig.run_until_done()
        summary = rig.summary("approx")
        assert summary["reused_tokens_by_mode"] == {"exact": BS, "survivor": BS + 4}
        assert summary["approximate_from"] == BS and summary["policy"]
        exact_only = {"params": {"orbitkv": {"modes": ["exact"]}}, **salt}
        assert rig.local_hit("exact", prompt, **exact_only) == BS
        assert rig.local_hit("off", prompt, params={"orbitkv": {"load": False}}, **salt) == BS
        assert rig.local_hit("salted", prompt, **salt) == BS
        assert rig.local_hit("same", prompt, **opted) == 2 * BS
        # A request under that policy, admitted: its hit's lineage comes with it.
        rig.add("again", prompt, **opted)
        rig.run_until_done()
        assert rig.summary("again")["approximate_from"] == BS
        assert rig.prefill_stats("again").num_local_cached_tokens == 2 * BS
    finally:
        rig.close()


def test_prompt_logprobs_requests_get_neither_loads_nor_holes(model_dir):
    """vLLM serves a request that needs prompt logprobs nothing cached, since every prompt row
    must be computed; OrbitKV neither, holes included."""
    rig = SchedulerRig(model_dir, extra_config={"orbitkv_min_hole_tokens": 16})
    try:
        prompt = _prompt(9, 4)
        rig.store_chunks(prompt, [0, 2])  # a prefix run and a hole behind fresh tokens
        rig.add("logprobs", prompt, prompt_logprobs=1)
        computed = 0
        for _ in range(20):
            if "logprobs" not in rig.scheduler.requests:
                break
            out = rig.step()
            assert not out.kv_connector_metadata.loads
            computed += out.num_scheduled_tokens.get("logprobs", 0)
        assert computed >= len(prompt)
        assert rig.summary("logprobs")["num_reused_tokens"] == 0
    finally:
        rig.close()
