"""Selective recompute in a real vLLM engine (CPU): a moved chunk served ``recompute`` has its first
tokens computed by vLLM in context and the rest loaded (its canonical, relocated) as a hole; a
request that did not opt in is served exact.

Checked against a run with the connector off: the recomputed tokens' KV equals the full prefill's
bit for bit at every layer (vLLM computed them, in context), while the loaded rest differs from it
beyond layer 0 (the canonical lacks the chunk before it): approximate KV, counted as such.
"""

from __future__ import annotations

import pytest
import torch
from connector_vllm_testlib import CHUNK, OFF, assert_informative, flush, segment, summary, tokens
from connector_vllm_testlib import engine as start_engine

pytestmark = pytest.mark.vllm

ANCHOR = [1]
FRACTION = 0.25
NUM_FRESH = 8  # ceil(0.25 * 32)
OPT_IN = {"orbitkv": {"approximate": True, "modes": ["exact", "recompute"]}}
NAMES_ONLY = {"orbitkv": {"modes": ["exact", "recompute"]}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    model_dir = make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")
    extra = {"orbitkv_anchor_tokens": ANCHOR, "orbitkv_enable_recompute": True,
             "orbitkv_recompute_fraction": FRACTION, "orbitkv_patch_rank": 0}
    with start_engine(model_dir, extra) as eng:
        yield eng


def _moved_chunk_prompt(engine, seed: int) -> list[int]:
    """``anchor . a . b . q`` after ``anchor . a`` and ``anchor . b`` ran alone: a is exact, b has
    only its canonical (it never followed a)."""
    a, b = segment(seed), segment(seed + 1)
    for chunk in (a, b):
        engine.run(tokens(ANCHOR + chunk + segment(seed + 50, 4)), keep_prefix_cache=False)
    flush(engine)
    return ANCHOR + a + b + segment(seed + 99, 8)


def test_recompute_is_not_served_without_opt_in(engine):
    prompt = _moved_chunk_prompt(engine, 300)
    out, _ = engine.run(tokens(prompt), NAMES_ONLY, keep_prefix_cache=False)
    got = summary(out)
    # Only the exact prefix (anchor . a); b is computed, no hole, nothing approximate.
    assert got["reused_tokens_by_mode"] == {"exact": 1 + CHUNK}
    assert got["num_hole_tokens"] == 0 and got["num_approximate_tokens"] == 0
    assert out.num_cached_tokens == 1 + CHUNK


def test_recomputed_tokens_are_computed_in_context_and_the_rest_loaded(engine):
    prompt = _moved_chunk_prompt(engine, 400)
    n = len(prompt)
    b_start = 1 + CHUNK
    ref, ref_blocks = engine.run(tokens(prompt), OFF)
    assert_informative(ref)
    want = engine.kv_layers(ref_blocks, 0, n - 1)
    engine.poison(ref_blocks)

    out, blocks = engine.run(tokens(prompt), OPT_IN, keep_prefix_cache=False)
    got = summary(out)
    num_loaded = CHUNK - NUM_FRESH
    assert got["reused_tokens_by_mode"] == {"exact": b_start, "recompute": num_loaded}
    assert got["num_hole_tokens"] == num_loaded
    assert got["num_approximate_tokens"] > 0 and got["num_failed_load_tokens"] == 0
    # vLLM's own count: it computed b's first 8 tokens and the question, nothing else.
    assert out.num_cached_tokens == b_start + num_loaded
    assert n - out.num_cached_tokens == NUM_FRESH + 8

    kv = engine.kv_layers(blocks, 0, n - 1)
    fresh = slice(b_start, b_start + NUM_FRESH)
    loaded = slice(b_start + NUM_FRESH, b_start + CHUNK)
    for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(kv, want, strict=True)):
        assert torch.equal(k[:b_start], k_ref[:b_start]), f"layer {layer}: the exact prefix"
        assert torch.equal(k[fresh], k_ref[fresh]) and torch.equal(v[fresh], v_ref[fresh]), (
            f"layer {layer}: b's recomputed tokens are not the full prefill's"
        )
    # Beyond layer 0 the loaded rest is the canonical's, not the prefill's (a is missing from it).
    k_deep, _ = kv[-1]
    k_deep_ref, _ = want[-1]
    assert not torch.equal(k_deep[loaded], k_deep_ref[loaded])
