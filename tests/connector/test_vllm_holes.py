"""Holes in a real vLLM engine (CPU): cached chunks behind fresh tokens, served by the scheduler
extension (``orbitkv.connector.vllm_ext.hole_scheduler``), checked against a run with the connector off.

"Fresh" text here is text whose entries are not in the store (deleted after a first run): the
chunks behind it then keep their exact antecedent, so the holes are exact and the whole KV must
equal the reference's, bit for bit.
"""

from __future__ import annotations

import time

import pytest
import torch
from connector_vllm_testlib import (
    CHUNK,
    OFF,
    StoreWithout,
    assert_informative,
    flush,
    segment,
    summary,
    tokens,
)
from connector_vllm_testlib import engine as start_engine

pytestmark = pytest.mark.vllm

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    model_dir = make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")
    with start_engine(model_dir) as eng:
        yield eng


def _conditioned_keys(chunks) -> list[str]:
    from orbitkv.store.keys import conditioned_key

    return [conditioned_key(c.cid, c.antecedent_hash) for c in chunks]


def _forget(engine, keys: list[str]) -> None:
    """Entries gone from every tier: the chunks they held are fresh to the next request."""
    flush(engine)
    engine.sched_connector.store.delete(keys)


def _all_kv(engine, blocks, n):
    return [engine.kv(blocks, 0, n, layer) for layer in range(NUM_LAYERS)]


def _assert_same_kv(got, want) -> None:
    for layer, ((k_got, v_got), (k_want, v_want)) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want), f"layer {layer}"


def _holed_prompt(seed: int) -> tuple[list[int], list[int]]:
    """``sys . t1 . c1 . t2 . c2 . question``, and the chunk indices of t1 and t2."""
    sys_, t1, c1, t2, c2 = (segment(seed + i) for i in range(5))
    return sys_ + t1 + c1 + t2 + c2 + segment(seed + 99, 8), [1, 3]


def _cache_with_fresh_text(engine, prompt, fresh) -> list[int]:
    """Run ``prompt`` once (everything saved), then forget the chunks at ``fresh``."""
    first, first_blocks = engine.run(tokens(prompt))
    assert summary(first)["num_saved_chunks"] == len(engine.last_chunks)
    keys = _conditioned_keys(engine.last_chunks)
    _forget(engine, [keys[i] for i in fresh])
    engine.poison(first_blocks)
    return keys


def test_exact_holes_reproduce_the_reference(engine, monkeypatch):
    prompt, fresh = _holed_prompt(700)
    n = len(prompt)
    ref, ref_blocks = engine.run(tokens(prompt), OFF)
    assert_informative(ref)
    want = _all_kv(engine, ref_blocks, n - 1)
    engine.poison(ref_blocks)
    _cache_with_fresh_text(engine, prompt, fresh)

    # What vLLM takes from the scheduler's connector each step: the scheduler extension's own
    # time (guard, holes) is reported beside the connector's parts.
    connector, reported = engine.sched_connector, []
    take = connector.get_kv_connector_stats
    monkeypatch.setattr(connector, "get_kv_connector_stats",
                        lambda: reported.append(s := take()) or s)
    second, blocks = engine.run(tokens(prompt))
    parts = {k for stats in reported if stats is not None for k in stats.data}
    assert {"seconds.chunk", "seconds.guard", "seconds.holes", "seconds.plan"} <= parts, parts
    got = summary(second)
    # sys is the prefix run; c1 and c2 are holes behind fresh t1 and t2; the question is computed.
    assert got["reused_tokens_by_mode"] == {"exact": 3 * CHUNK}
    assert got["num_hole_tokens"] == 2 * CHUNK and got["num_approximate_tokens"] == 0
    assert got["num_failed_load_tokens"] == 0
    # vLLM's own accounting (cached_tokens, prompt_tokens_by_source) includes the holes.
    assert second.num_cached_tokens == 3 * CHUNK
    assert second.outputs[0].token_ids == ref.outputs[0].token_ids
    _assert_same_kv(_all_kv(engine, blocks, n - 1), want)


def test_request_with_reuse_off_gets_no_holes(engine):
    prompt, fresh = _holed_prompt(800)
    _cache_with_fresh_text(engine, prompt, fresh)
    out, _ = engine.run(tokens(prompt), {"orbitkv": {"load": False}})
    assert summary(out)["num_reused_tokens"] == 0 and out.num_cached_tokens == 0


def test_vanished_hole_entry_is_recomputed(engine, monkeypatch):
    prompt, fresh = _holed_prompt(900)
    ref, _ = engine.run(tokens(prompt), OFF)
    assert_informative(ref)
    keys = _cache_with_fresh_text(engine, prompt, fresh)
    store = engine.worker._store
    monkeypatch.setattr(engine.worker, "_store", StoreWithout(store, {keys[4]}))  # c2
    out, _ = engine.run(tokens(prompt))
    got = summary(out)
    # vLLM recomputes from c2's first block: sys and the c1 hole stay served, c2 is recomputed.
    assert got["reused_tokens_by_mode"] == {"exact": 2 * CHUNK}
    assert got["num_failed_load_tokens"] == CHUNK
    assert out.num_cached_tokens == 2 * CHUNK
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_preemption_in_a_holed_prefill_recovers(engine):
    """vLLM's own preemption (``_preempt_request``) right after the step that stops at a hole:
    the request is planned afresh, finishes with the reference's output, and holds nothing."""
    from vllm import SamplingParams

    prompt, fresh = _holed_prompt(1000)
    ref, _ = engine.run(tokens(prompt), OFF)
    assert_informative(ref)
    _cache_with_fresh_text(engine, prompt, fresh)
    assert engine.llm.reset_prefix_cache()
    scheduler = engine.core.scheduler
    half = engine.sched_connector.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    num_free = pool.get_num_free_blocks()

    llm_engine = engine.llm.llm_engine
    sp = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2)
    llm_engine.add_request("holed", tokens(prompt), sp)
    llm_engine.step()  # sys from the store, t1 computed: the prefill stops at c1's hole
    (request,) = scheduler.running
    assert request.num_computed_tokens == 2 * CHUNK
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())
    outputs = []
    while llm_engine.has_unfinished_requests():
        outputs += [o for o in llm_engine.step() if o.finished]
    (out,) = outputs
    assert request.num_preemptions == 1
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    # The new admission starts from vLLM's prefix cache (sys and t1, computed before the
    # preemption), loads c1 as the prefix run and jumps c2's hole; the ledger counts only that.
    got = summary(out)
    assert got["reused_tokens_by_mode"] == {"exact": 2 * CHUNK}
    assert got["num_hole_tokens"] == CHUNK
    flush(engine)
    assert engine.llm.reset_prefix_cache()
    assert pool.get_num_free_blocks() == num_free
    memory = engine.sched_connector.store.memory
    assert [k for k in memory.iter_keys() if memory.pin_count(k)] == []
    assert half.num_tracked_requests == 0


def test_holes_refused_where_a_jump_would_be_wrong():
    from types import SimpleNamespace

    from orbitkv.connector.vllm_ext.hole_scheduler import hole_refusal
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    def config(**over):
        base = dict(
            use_v2_model_runner=False,
            speculative_config=None,
            parallel_config=SimpleNamespace(pipeline_parallel_size=1),
            scheduler_config=SimpleNamespace(enable_chunked_prefill=True),
        )
        return SimpleNamespace(**{**base, **over})

    def groups(*specs):
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128
    )
    assert hole_refusal(config(), groups(full)) is None
    v2 = config(use_v2_model_runner=True)
    assert "VLLM_USE_V2_MODEL_RUNNER" in hole_refusal(v2, groups(full))
    assert hole_refusal(v2, groups(full), is_v2_enabled=True) is None  # enable_v2_holes
    assert "hybrid" in hole_refusal(v2, groups(full, window), is_v2_enabled=True)
    assert "speculative" in hole_refusal(config(speculative_config=object()), groups(full))
    pp2 = SimpleNamespace(pipeline_parallel_size=2)
    assert "pipeline" in hole_refusal(config(parallel_config=pp2), groups(full))
    assert "hybrid" in hole_refusal(config(), groups(full, window))
    assert "SlidingWindowSpec" in hole_refusal(config(), groups(window))
    no_chunking = SimpleNamespace(enable_chunked_prefill=False)
    assert "chunked prefill" in hole_refusal(config(scheduler_config=no_chunking), groups(full))
