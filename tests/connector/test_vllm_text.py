"""OrbitKVConnector in a real vLLM engine on the CPU: one tiny Qwen2 engine for the whole module."""

from __future__ import annotations

import pytest
import torch
from connector_vllm_testlib import (
    CHUNK,
    OFF,
    OPT_IN,
    StoreWithout,
    assert_informative,
    assert_loaded_as_relocated,
    assert_relocated_like_prefill,
    bf16_ulp,
    pair_magnitude,
    segment,
    summary,
    tokens,
)
from connector_vllm_testlib import engine as start_engine

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    model_dir = make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")
    with start_engine(model_dir) as eng:
        yield eng


def test_exact_repeat_reuses_all_but_last_token(engine):
    prompt = [t for i in range(4) for t in segment(100 + i)] + segment(199, 8)
    ref, _ = engine.run(tokens(prompt), OFF)
    assert_informative(ref)
    first, first_blocks = engine.run(tokens(prompt))
    # vLLM ran handle_preemptions before each step: the saves were copied between steps
    # (``worker/saving.py``), and the second run loads what those copies stored.
    assert engine.worker._saves.is_deferred
    want = [engine.kv(first_blocks, 0, len(prompt) - 1, layer) for layer in range(4)]
    engine.poison(first_blocks)
    second, second_blocks = engine.run(tokens(prompt))

    assert summary(first)["num_reused_tokens"] == 0
    assert summary(first)["num_saved_chunks"] == 5
    assert summary(second)["reused_tokens_by_mode"] == {"exact": len(prompt) - 1}
    assert second.num_cached_tokens == len(prompt) - 1
    assert ref.outputs[0].token_ids == first.outputs[0].token_ids == second.outputs[0].token_ids
    for layer, (k1, v1) in enumerate(want):
        k2, v2 = engine.kv(second_blocks, 0, len(prompt) - 1, layer)
        assert torch.equal(k1, k2) and torch.equal(v1, v2), f"layer {layer}"


def test_sliding_window_serves_survivors_relocated(engine):
    sys_, c1, c2, c3, c4 = (segment(200 + i) for i in range(5))
    q1, q2 = segment(298, 8), segment(299, 8)
    # Survivor KV is approximate: only a request in its own namespace (a cache_salt) gets it.
    salt = {"cache_salt": "agent-1"}
    _, first_blocks = engine.run(tokens(sys_ + c1 + c2 + c3 + q1, **salt), max_tokens=4)
    k_stored_c2 = engine.kv(first_blocks, 2 * CHUNK, 3 * CHUNK, 0)[0]
    stored = engine.kv_layers(first_blocks, 2 * CHUNK, 4 * CHUNK)
    engine.poison(first_blocks)
    prompt = sys_ + c2 + c3 + c4 + q2
    served, served_blocks = engine.run(tokens(prompt, **salt), OPT_IN, max_tokens=4)
    served_summary = summary(served)
    assert served_summary["reused_tokens_by_mode"] == {"exact": CHUNK, "survivor": 2 * CHUNK}
    assert served_summary["approximate_from"] == CHUNK
    assert served.num_cached_tokens == 3 * CHUNK
    k_got, v_got = engine.kv(served_blocks, 0, 3 * CHUNK, 0)
    # Every layer of c2 and c3 is their stored KV moved up by one chunk.
    assert_loaded_as_relocated(engine, engine.kv_layers(served_blocks, CHUNK, 3 * CHUNK), stored, -CHUNK)
    engine.poison(served_blocks)
    _, ref_blocks = engine.run(tokens(prompt, **salt), OFF, max_tokens=4)
    k_want, v_want = engine.kv(ref_blocks, 0, 3 * CHUNK, 0)
    assert_relocated_like_prefill(k_got, k_want, v_got, v_want)
    assert torch.equal(k_got[:CHUNK], k_want[:CHUNK])  # sys is exact, not moved
    # c2 moved from 64 to 32: its keys as stored are far from the relocated ones.
    moved = k_want[CHUNK : 2 * CHUNK]
    diff = (k_stored_c2.float() - moved.float()).abs()
    assert (diff / bf16_ulp(pair_magnitude(moved))).max() > 16


def test_connector_extends_a_local_prefix_cache_hit(engine):
    sys_, c1, c2 = (segment(300 + i) for i in range(3))
    q1, q2 = segment(398, 8), segment(399, 8)
    engine.run(tokens(sys_ + c1 + c2 + q1, cache_salt="agent-2"), max_tokens=4)
    # vLLM's prefix cache still holds sys (one full block); the connector goes on from there.
    served, _ = engine.run(
        tokens(sys_ + c2 + q2, cache_salt="agent-2"), OPT_IN, max_tokens=4, keep_prefix_cache=True
    )
    assert summary(served)["reused_tokens_by_mode"] == {"survivor": CHUNK}
    assert served.num_cached_tokens == 2 * CHUNK
    assert len(served.outputs[0].token_ids) == 4


class _StoreWithoutEntries:
    """The worker's store as if every entry was evicted after the scheduler planned its load."""

    def __init__(self, store) -> None:
        self._store = store

    def get(self, keys, **kwargs):
        return [None] * len(keys)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_failed_load_is_recomputed_not_served(engine, monkeypatch):
    prompt = [t for i in range(3) for t in segment(400 + i)] + segment(499, 8)
    ref, _ = engine.run(tokens(prompt), OFF, max_tokens=16)
    assert_informative(ref)
    engine.run(tokens(prompt), max_tokens=1, keep_prefix_cache=False)
    monkeypatch.setattr(engine.worker, "_store", _StoreWithoutEntries(engine.worker._store))
    out, _ = engine.run(tokens(prompt), max_tokens=16, keep_prefix_cache=False)
    assert summary(out)["num_reused_tokens"] == 0
    assert summary(out)["num_failed_load_tokens"] == len(prompt) - 1
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_failed_first_chunk_unserves_everything_after_it(engine, monkeypatch):
    """vLLM recomputes from the first invalid block, loaded or not: the summary and vLLM's own
    cached-token count say so (0 served), even though later chunks loaded fine."""
    from orbitkv.store.keys import conditioned_key

    prompt = [t for i in range(4) for t in segment(450 + i)] + segment(459, 8)
    ref, _ = engine.run(tokens(prompt), OFF, max_tokens=8)
    assert_informative(ref)
    engine.run(tokens(prompt), max_tokens=1, keep_prefix_cache=False)
    first = engine.last_chunks[0]
    gone = {conditioned_key(first.cid, first.antecedent_hash)}
    monkeypatch.setattr(engine.worker, "_store", StoreWithout(engine.worker._store, gone))
    out, _ = engine.run(tokens(prompt), max_tokens=8, keep_prefix_cache=False)
    got = summary(out)
    assert got["num_reused_tokens"] == 0 and got["reused_tokens_by_mode"] == {}
    assert got["num_failed_load_tokens"] == len(prompt) - 1
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_an_entry_of_another_shape_is_recomputed_not_a_crash(engine):
    """A crafted entry under the key a request looks up: 3 KV heads for this 2-KV-head model, its
    digests and checksum right, batched with well-formed loads. The load fails, vLLM recomputes
    from it, and the answer is the reference's; the chunk before it is still served."""
    from orbitkv.store.entry import Entry
    from orbitkv.store.keys import conditioned_key

    prompt = [t for i in range(3) for t in segment(600 + i)] + segment(699, 8)
    ref, _ = engine.run(tokens(prompt), OFF, max_tokens=16)
    assert_informative(ref)
    engine.run(tokens(prompt), max_tokens=1, keep_prefix_cache=False)
    engine.sched_connector.writer.flush()
    second = engine.last_chunks[1]
    key = conditioned_key(second.cid, second.antecedent_hash)
    store = engine.worker._store
    (good,) = store.get([key])
    assert good is not None and good.tensors["k.0"].shape[1] == 2
    store.put(key, Entry(good.meta, {n: torch.cat([t, t[:, :1]], 1) for n, t in good.tensors.items()}))
    out, _ = engine.run(tokens(prompt), max_tokens=16, keep_prefix_cache=False)
    got = summary(out)
    assert got["reused_tokens_by_mode"] == {"exact": CHUNK}
    assert got["num_failed_load_tokens"] == len(prompt) - 1 - CHUNK
    assert out.num_cached_tokens == CHUNK
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
