"""Crafted entries at the worker half: an entry (or patch) that does not fit the model's cache is
a failed load that vLLM recomputes, never an exception in the forward pass, and it fails only its
own blocks: the loads batched with it still load.

The entries go through the real store (encoded, stored, decoded and verified): what a forger or a
replica of another model writes under a key this request looks up.
"""

from __future__ import annotations

import pytest
import torch
from halves_testlib import BS, CS, D, H, L, compute
from halves_testlib import kv as _kv
from halves_testlib import new_step as _new
from halves_testlib import request as _request
from halves_testlib import step as _step
from orbitkv.store.entry import Entry


def _heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    return torch.cat([t, t[:, :1]], dim=1) if num_heads > t.shape[1] else t[:, :num_heads]


CRAFTS = {
    "3 kv heads for a 2-head model": lambda ts: {n: _heads(t, H + 1) for n, t in ts.items()},
    "1 kv head": lambda ts: {n: _heads(t, 1) for n, t in ts.items()},
    "half the head_dim": lambda ts: {n: t[..., : D // 2].contiguous() for n, t in ts.items()},
    "a token fewer than the header says": lambda ts: {n: t[1:].clone() for n, t in ts.items()},
    "flat tensors": lambda ts: {n: t.flatten().clone() for n, t in ts.items()},
    "fp16 in an fp32 cache": lambda ts: {n: t.half() for n, t in ts.items()},
    "a layer more": lambda ts: {**ts, f"k.{L}": ts["k.0"], f"v.{L}": ts["v.0"]},
    "a layer less": lambda ts: {n: t for n, t in ts.items() if not n.endswith(f".{L - 1}")},
}


def _stored_then_planned(halves):
    """Request "a" computed and saved (3 chunks); request "b" with the same prompt planned to
    load them all into blocks 20-22 (one batched call per layer: short chunks)."""
    sched, _, caches, shared = halves
    tokens = [5] * CS + [6] * CS + [7] * CS + [8]
    compute(halves, "a", tokens, [1, 2, 3, 4], seed=4)
    b = _request("b", tokens)
    assert sched.get_num_new_matched_tokens(b, 0) == (3 * CS, False)
    sched.update_state_after_alloc(b, None, 3 * CS)
    meta = sched.build_connector_meta(_new("b", [20, 21, 22, 23], 0, 1))
    assert [(s.offset, len(s.slots)) for s in meta.loads] == [(0, CS)] * 3
    return meta


@pytest.mark.parametrize("craft", CRAFTS)
def test_an_entry_that_does_not_fit_is_recomputed_alone(halves, craft):
    sched, worker, caches, shared = halves
    meta = _stored_then_planned(halves)
    key = meta.loads[1].key
    (good,) = shared.store.get([key])
    shared.store.put(key, Entry(good.meta, CRAFTS[craft](good.tensors)))
    (stored,) = shared.store.get([key])
    assert stored is not None  # a valid entry as far as the store can tell

    _step(worker, meta, caches)  # must not raise

    assert worker.get_block_ids_with_load_errors() == {21}
    assert worker.take_stats().reduce()["failed_loads"] == 1
    # The loads batched with it went in as stored.
    for begin, block in ((0, 20), (2 * CS, 22)):
        got = _kv(caches, [block], 0, CS)
        want = _kv(caches, [1, 2, 3], begin, begin + CS)
        for (k_got, v_got), (k_want, v_want) in zip(got, want, strict=True):
            assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)


PATCH_CRAFTS = {
    "no V factors": lambda ts: {n: t for n, t in ts.items() if n[1] != "v"},
    "no W factor for V": lambda ts: {n: t for n, t in ts.items() if not n.startswith("wv.")},
    "integer factors": lambda ts: {n: t.to(torch.int32) for n, t in ts.items()},
}


@pytest.mark.parametrize("craft", PATCH_CRAFTS)
def test_a_patch_that_does_not_fit_is_recomputed(patched_halves, craft):
    sched, worker, caches, shared = patched_halves
    b, x = [6] * 4, [3] * 4
    compute(patched_halves, "canon", b + [1], [1, 2], seed=9)
    meta = compute(patched_halves, "cond", x + b + [2], [3, 4, 5], seed=10)
    b_save = next(s for s in meta.saves if s.start == 4)
    patch_key, _ = worker._patches.keys(b_save.cid, b_save.antecedent)
    (patch,) = shared.store.get([patch_key])
    shared.store.put(patch_key, Entry(patch.meta, PATCH_CRAFTS[craft](patch.tensors)))
    shared.store.delete([b_save.keys["conditioned"]])
    later = _request("later", x + b + [2])
    assert sched.get_num_new_matched_tokens(later, 0) == (8, False)
    sched.update_state_after_alloc(later, None, 8)
    meta = sched.build_connector_meta(_new("later", [6, 7, 8], 0, 1))
    assert [s.mode for s in meta.loads] == ["exact", "patched"]

    _step(worker, meta, caches)  # must not raise

    assert worker.get_block_ids_with_load_errors() == {7}
    for (k_got, v_got), (k_want, v_want) in zip(
        _kv(caches, [6], 0, BS), _kv(caches, [3], 0, BS), strict=True
    ):
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)


@pytest.mark.parametrize("path", ["load_stacked_rows", "load_many", "load_chunk"])
def test_a_load_that_fails_in_the_kernel_fails_only_its_blocks(halves, monkeypatch, path):
    """Whatever still goes wrong once the entries passed their checks is a failed load too: in
    the one call for every layer (CPU_VEC: of stacked layers, or job by job where an entry's
    layers are no one view), or in the per-layer calls (where it cannot run)."""
    from orbitkv.connector.worker import loading

    sched, worker, caches, shared = halves
    meta = _stored_then_planned(halves)

    def broken(*args, **kwargs):
        raise IndexError("a kernel bug")

    if path != "load_stacked_rows":
        monkeypatch.setattr(loading, "layer_stacks", lambda *a: None)
    if path == "load_chunk":
        monkeypatch.setattr(loading, "load_many", lambda *a, **k: False)
    monkeypatch.setattr(loading, path, broken)
    _step(worker, meta, caches)  # must not raise
    assert worker.get_block_ids_with_load_errors() == {20, 21, 22}


def test_a_read_that_failed_on_memory_is_a_store_error_not_corruption(monkeypatch):
    """The connector exports a transient read failure with the store's I/O faults; the entry is
    kept (``tests/store/test_store_entry_bounds.py``)."""
    from orbitkv.connector.runtime import _store_faults
    from orbitkv.store import buffers
    from orbitkv.store.entry import make_entry
    from orbitkv.store.keys import EntryKey, chunk_cid
    from orbitkv.store.tiered import TieredStore

    def out_of_memory(nbytes):
        raise MemoryError(nbytes)

    key = EntryKey(chunk_cid("fp", "mha", "tenant", [1, 2, 3]), "canonical")
    entry = make_entry("canonical", {"k.0": torch.ones(3, H, D), "v.0": torch.ones(3, H, D)},
                       model_fingerprint="fp", layout="mha")
    with TieredStore(memory_nbytes=1 << 20) as store:
        store.put(key, entry)
        monkeypatch.setattr(buffers, "take", out_of_memory)
        assert store.get([key]) == [None]
        monkeypatch.undo()
        faults = _store_faults(store)
        assert faults == {"store_errors": 1.0, "corrupt_entries": 0.0, "planning_timeouts": 0.0,
                          "dropped_store_writes": 0.0}
        assert store.get([key])[0] is not None
