"""Exact stays exact in a real vLLM engine (CPU, seeded tiny models), with vLLM's prefix cache
kept across requests: approximate KV never reaches a request that did not opt in, nothing computed
over a failed load is stored as exact, LoRA adapters never share KV, prompt embeddings are left to
vLLM. Every exact claim is checked against a full prefill (connector off, own cache salt), bit for
bit over all layers."""

from __future__ import annotations

import pytest
import torch
from connector_vllm_testlib import (
    OFF,
    OPT_IN,
    StoreWithout,
    assert_informative,
    flush,
    segment,
    summary,
    tokens,
)
from connector_vllm_testlib import engine as start_engine

pytestmark = pytest.mark.vllm
CHUNK = 32
SALT = "agent-7"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")


@pytest.fixture(scope="module")
def engine(model_dir):
    with start_engine(model_dir, load_format="auto") as eng:
        yield eng


def _assert_kv_equal(engine, got_blocks, want, begin, end, what):
    """``want``: KV read off a reference run right after it (a finished request's blocks are
    given to the next request)."""
    got = engine.kv_layers(got_blocks, begin, end)
    for layer, ((kg, vg), (kw, vw)) in enumerate(zip(got, want, strict=True)):
        kw, vw = kw[begin:end], vw[begin:end]
        assert torch.equal(kg, kw) and torch.equal(vg, vw), f"{what}: layer {layer} differs"


def _stored_exact_entries(engine, chunks):
    """The exact conditioned entries the store holds for these chunks (key -> entry)."""
    from orbitkv.store.keys import conditioned_key

    keys = [conditioned_key(c.cid, c.antecedent_hash) for c in chunks]
    store = engine.sched_connector.store
    return {k: e for k, e in zip(keys, store.get(keys), strict=True) if e is not None}


def test_approximate_kv_never_reaches_exact_requests_through_vllms_cache(engine):
    """An agent's turn that opted in is served survivor KV (approximate) and leaves its blocks in
    vLLM's prefix cache. The same prompt asked exact-only, with loads off, or in the same salted
    session without opting in, gets a full prefill's KV bit for bit (and its greedy tokens); the
    same policy gets the approximate blocks, reported."""
    sys_, c1, c2 = segment(500), segment(501), segment(502)
    q1, q2 = segment(598, 8), segment(599, 8)
    engine.run(tokens(sys_ + c1 + c2 + q1, cache_salt=SALT), max_tokens=2)
    flush(engine)
    prompt = sys_ + c2 + q2
    approx, approx_blocks = engine.run(tokens(prompt, cache_salt=SALT), OPT_IN, max_tokens=8)
    assert summary(approx)["reused_tokens_by_mode"].get("survivor", 0) >= CHUNK
    assert summary(approx)["approximate_from"] == CHUNK
    # The agent's next turn, same policy: vLLM's prefix cache serves the approximate blocks, and
    # the summary says where they start.
    turn, _ = engine.run(tokens(prompt, cache_salt=SALT), OPT_IN, max_tokens=8, keep_prefix_cache=True)
    assert turn.num_cached_tokens >= 2 * CHUNK
    assert summary(turn)["approximate_from"] == CHUNK
    ref, ref_blocks = engine.run(tokens(prompt), OFF, max_tokens=8, keep_prefix_cache=True)
    assert_informative(ref)
    n = len(prompt) - 1  # vLLM computes the last prompt token itself, always
    want = engine.kv_layers(ref_blocks, 0, len(prompt))
    for name, params in (("exact-only", {"orbitkv": {"modes": ["exact"]}}),
                         ("loads off", {"orbitkv": {"load": False}}),
                         ("salted, not opted in", None),
                         ("modes named, not opted in", {"orbitkv": {"modes": ["exact", "survivor"]}})):
        out, blocks = engine.run(
            tokens(prompt, cache_salt=SALT), params, max_tokens=8, keep_prefix_cache=True
        )
        s = summary(out)
        assert s["num_approximate_tokens"] == 0 and s["approximate_from"] is None, name
        assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids), name
        _assert_kv_equal(engine, blocks, want, 0, n, name)
    # Whatever the store now holds as exact for this prompt is a full prefill's KV.
    flush(engine)
    stored = _stored_exact_entries(engine, engine.last_chunks)
    assert stored
    for key, entry in stored.items():
        c = next(c for c in engine.last_chunks if c.cid in key)
        for layer, (k, v) in enumerate(want):
            k, v = k[c.start : c.end], v[c.start : c.end]
            assert torch.equal(entry.tensors[f"k.{layer}"], k), (key, layer)
            assert torch.equal(entry.tensors[f"v.{layer}"], v), (key, layer)
    # Now that exact copies of those blocks are cached too, the same policy is served them.
    again, _ = engine.run(tokens(prompt, cache_salt=SALT), OPT_IN, max_tokens=8, keep_prefix_cache=True)
    assert again.num_cached_tokens >= 2 * CHUNK
    assert summary(again)["approximate_from"] is None


def test_nothing_computed_over_a_failed_load_is_stored(engine, monkeypatch):
    """[a, c, q]: a's load fails in the step that also computes c over a's unwritten blocks. That
    c is never stored; vLLM recomputes from a's block, and what is then stored (a and c, exact)
    is a full prefill's KV; the next request is served it and answers as the reference."""
    a, c = segment(610), segment(611)
    engine.run(tokens(a + segment(612, 8)), max_tokens=1)
    flush(engine)
    (a_key,) = _stored_exact_entries(engine, engine.last_chunks[:1])
    prompt = a + c + segment(613, 8)
    ref, ref_blocks = engine.run(tokens(prompt), OFF, max_tokens=8)
    assert_informative(ref)
    want = engine.kv_layers(ref_blocks, 0, len(prompt))
    store = engine.worker._store
    monkeypatch.setattr(engine.worker, "_store", StoreWithout(store, {a_key}))
    # a must come from OrbitKV's store (whose copy is gone), not from vLLM's own cache.
    out, _ = engine.run(tokens(prompt), max_tokens=8, keep_prefix_cache=False)
    monkeypatch.setattr(engine.worker, "_store", store)
    assert summary(out)["num_failed_load_tokens"] >= CHUNK
    assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
    flush(engine)
    chunks = engine.last_chunks
    stored = _stored_exact_entries(engine, chunks[:2])
    assert len(stored) == 2
    for key, entry in stored.items():
        ch = next(ch for ch in chunks if ch.cid in key)
        for layer, (k, v) in enumerate(want):
            assert torch.equal(entry.tensors[f"k.{layer}"], k[ch.start : ch.end]), (key, layer)
            assert torch.equal(entry.tensors[f"v.{layer}"], v[ch.start : ch.end]), (key, layer)
    served, served_blocks = engine.run(tokens(prompt), max_tokens=8, keep_prefix_cache=False)
    assert summary(served)["reused_tokens_by_mode"] == {"exact": len(prompt) - 1}
    assert list(served.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
    _assert_kv_equal(engine, served_blocks, want, 0, len(prompt) - 1, "served")


def test_prompt_logprobs_are_computed_for_every_prompt_token(engine):
    """vLLM serves a prompt-logprobs request nothing cached; OrbitKV neither (no prefix run, no
    hole), so every prompt row has its logprob and equals the reference's."""
    prompt = [t for i in range(4) for t in segment(620 + i)] + segment(629, 8)
    engine.run(tokens(prompt), max_tokens=1)
    flush(engine)
    ref, _ = engine.run(tokens(prompt), OFF, max_tokens=2, prompt_logprobs=1)
    out, _ = engine.run(tokens(prompt), max_tokens=2, prompt_logprobs=1, keep_prefix_cache=True)
    assert summary(out)["num_reused_tokens"] == 0
    got, want = out.prompt_logprobs, ref.prompt_logprobs
    assert len(got) == len(want) == len(prompt)
    for i, (g, w) in enumerate(zip(got[1:], want[1:], strict=True), start=1):
        token = prompt[i]
        assert g is not None and g[token].logprob == w[token].logprob, i


@pytest.fixture(scope="module")
def lora_engine(model_dir, tmp_path_factory):
    from orbitkv.models.lora import make_lora_adapter

    root = tmp_path_factory.mktemp("lora")
    adapters = {name: make_lora_adapter(root / name, model_dir, seed) for name, seed in (("a", 1), ("b", 2))}
    with start_engine(
        model_dir, load_format="auto", enable_lora=True, max_lora_rank=8,
        enable_prompt_embeds=True,
    ) as eng:
        yield eng, adapters


def test_lora_adapters_never_share_kv(lora_engine):
    """Chunk ids carry the adapter (vLLM's block hash does too): the base model's KV is never
    served to an adapter, nor one adapter's to another; each adapter is served its own, exactly."""
    from vllm.lora.request import LoRARequest

    eng, adapters = lora_engine
    lora = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    prompt = [t for i in range(2) for t in segment(640 + i)] + segment(649, 8)
    eng.run(tokens(prompt), max_tokens=1)
    flush(eng)
    ref_a, ref_a_blocks = eng.run(tokens(prompt), OFF, max_tokens=8, lora_request=lora["a"])
    want = eng.kv_layers(ref_a_blocks, 0, len(prompt))
    ref_base, _ = eng.run(tokens(prompt), OFF, max_tokens=8)
    assert list(ref_a.outputs[0].token_ids) != list(ref_base.outputs[0].token_ids)
    first, _ = eng.run(tokens(prompt), max_tokens=8, lora_request=lora["a"])
    assert summary(first)["num_reused_tokens"] == 0  # nothing of the base model's
    assert list(first.outputs[0].token_ids) == list(ref_a.outputs[0].token_ids)
    flush(eng)
    other, _ = eng.run(tokens(prompt), max_tokens=8, lora_request=lora["b"])
    assert summary(other)["num_reused_tokens"] == 0  # nothing of adapter a's
    again, blocks = eng.run(tokens(prompt), max_tokens=8, lora_request=lora["a"], keep_prefix_cache=False)
    assert summary(again)["reused_tokens_by_mode"] == {"exact": len(prompt) - 1}
    assert list(again.outputs[0].token_ids) == list(ref_a.outputs[0].token_ids)
    _assert_kv_equal(eng, blocks, want, 0, len(prompt) - 1, "adapter a")


def test_prompt_embeddings_are_left_to_vllm(lora_engine, model_dir):
    """vLLM hashes prompt embeddings into its block hashes; OrbitKV would key them by placeholder
    ids, so such a request is refused: nothing loaded, nothing stored, the answer unchanged."""
    from safetensors.torch import load_file

    eng, _ = lora_engine
    table = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    ids = torch.tensor([t for i in range(2) for t in segment(660 + i)] + segment(669, 8))
    embeds = table[ids].to(torch.bfloat16)
    before = set(eng.sched_connector.store.memory.iter_keys())
    ref, _ = eng.run({"prompt_embeds": embeds}, OFF, max_tokens=8)
    out, _ = eng.run({"prompt_embeds": embeds}, max_tokens=8)
    flush(eng)
    assert summary(out)["refused"] == "prompt embeddings"
    assert summary(out)["num_reused_tokens"] == 0 and summary(out)["num_saved_chunks"] == 0
    assert set(eng.sched_connector.store.memory.iter_keys()) == before
    assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
