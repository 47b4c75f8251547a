"""The default save admission (``save_admission: recurring``) in a real vLLM engine on the CPU: a
prompt vLLM's prefix cache keeps is never saved; once vLLM lost it and it is computed again it is
saved, and the next time it is loaded, bit for bit what the engine computed."""

from __future__ import annotations

import pytest
import torch
from connector_vllm_testlib import OFF, flush, segment, summary, tokens
from connector_vllm_testlib import engine as start_engine

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    model_dir = make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")
    with start_engine(model_dir, {"save_admission": "recurring", "save_canonical": False}) as eng:
        yield eng


def test_a_prompt_is_saved_once_it_recurs_past_vllms_cache_then_loaded_exactly(engine):
    prompt = [t for i in range(4) for t in segment(300 + i)] + segment(399, 8)
    ref, _ = engine.run(tokens(prompt), OFF)
    first, first_blocks = engine.run(tokens(prompt))
    want = engine.kv_layers(first_blocks, 0, len(prompt) - 1)
    assert summary(first)["num_saved_chunks"] == 0 and summary(first)["num_declined_saves"] == 5
    # vLLM's prefix cache kept it: the full blocks are its hit, nothing before them is saved.
    kept, _ = engine.run(tokens(prompt))
    assert kept.num_cached_tokens > 0 and summary(kept)["num_saved_chunks"] <= 1
    # vLLM lost it: computed again, now saved (the last chunk, the question, is kept too: it
    # was computed before under the same key).
    again, _ = engine.run(tokens(prompt), keep_prefix_cache=False)
    assert summary(again)["num_reused_tokens"] == 0
    assert summary(again)["num_saved_chunks"] + summary(kept)["num_saved_chunks"] == 5
    flush(engine)
    third, third_blocks = engine.run(tokens(prompt), keep_prefix_cache=False)
    assert summary(third)["reused_tokens_by_mode"] == {"exact": len(prompt) - 1}
    assert ref.outputs[0].token_ids == first.outputs[0].token_ids == third.outputs[0].token_ids
    for layer, ((k1, v1), (k3, v3)) in enumerate(
        zip(want, engine.kv_layers(third_blocks, 0, len(prompt) - 1), strict=True)
    ):
        assert torch.equal(k1, k3) and torch.equal(v1, v3), f"layer {layer}"
