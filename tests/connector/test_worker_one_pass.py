"""The worker half loads every layer at the step's first ``wait_for_layer_load`` and gathers every
layer's saves at ``wait_for_save``: one pass a step, not one per layer (``worker/half.py``)."""

from __future__ import annotations

import pytest
import torch
from halves_testlib import compute, kv, new_step, request, step_meta

SYS, C1, Q = [1] * 4, [2] * 4, [9, 9]


def _admit(sched, req, blocks, num_sched):
    num, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, num or 0)
    return sched.build_connector_meta(new_step(req.request_id, blocks, num or 0, num_sched)), num


@pytest.mark.parametrize("is_native", [True, False])
def test_the_first_layer_call_loads_every_layer_and_later_calls_load_nothing(
    halves, monkeypatch, is_native
):
    """In one native call for every layer, or (no native op, a GPU cache) layer after layer."""
    from orbitkv.kernels import paged_native

    monkeypatch.setattr(paged_native, "is_enabled", is_native)
    sched, worker, caches, shared = halves
    compute(halves, "first", SYS + C1 + Q, [1, 2, 3], seed=1)
    stored = kv(caches, [1, 2, 3], 0, 8)
    meta, num = _admit(sched, request("again", SYS + C1 + [5, 5]), [4, 5, 6], 2)
    assert num == 8 and meta.loads
    names = list(caches)
    worker.start_load_kv(meta)
    worker.wait_for_layer_load(names[0])
    # Every layer holds the stored KV already (same positions: byte-equal).
    for (k0, v0), (k1, v1) in zip(stored, kv(caches, [4, 5, 6], 0, 8), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    # A later layer's call writes nothing: what the forward put there stays.
    caches[names[1]].zero_()
    worker.wait_for_layer_load(names[1])
    assert not caches[names[1]].any()
    worker.wait_for_save(meta)
    # The next step loads again.
    meta, _ = _admit(sched, request("third", SYS + C1 + [6, 6]), [7, 8, 9], 2)
    worker.start_load_kv(meta)
    worker.wait_for_layer_load(names[1])
    for (k0, v0), (k1, v1) in zip(stored, kv(caches, [7, 8, 9], 0, 8), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    worker.wait_for_save(meta)


def _computing_step(sched, caches, seed):
    """A first request computed whole in one step (nothing to load): its step's metadata."""
    return step_meta(sched, caches, "a", SYS + C1 + Q, [1, 2, 3], seed)


@pytest.mark.parametrize("is_native", [True, False])
def test_saves_gather_every_layer_that_ran_after_the_forward(halves, monkeypatch, is_native):
    """One native gather for every layer, or (no native op, a GPU cache) one gather per layer."""
    from orbitkv.kernels import paged_native

    monkeypatch.setattr(paged_native, "is_enabled", is_native)
    sched, worker, caches, shared = halves
    meta = _computing_step(sched, caches, seed=2)
    assert meta.saves
    expected = kv(caches, [1, 2, 3], 0, 10)
    worker.start_load_kv(meta)
    for name, cache in caches.items():
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, cache, meta)
    worker.wait_for_save(meta)
    shared.writer.flush()
    for spec in meta.saves:
        # The entry as computed here (a canonical is stored at position 0: rotated).
        (entry,) = shared.store.get([spec.keys["conditioned"]])
        assert entry is not None and entry.meta.start_pos == spec.start
        for li, (k, v) in enumerate(expected):
            assert torch.equal(entry.tensors[f"k.{li}"], k[spec.start : spec.end])
            assert torch.equal(entry.tensors[f"v.{li}"], v[spec.start : spec.end])


def test_a_save_whose_layers_did_not_all_run_is_skipped(halves):
    sched, worker, caches, shared = halves
    meta = _computing_step(sched, caches, seed=3)
    worker.start_load_kv(meta)
    first = next(iter(caches))
    worker.save_kv_layer(first, caches[first], meta)
    worker.wait_for_save(meta)
    shared.writer.flush()
    keys = [k for s in meta.saves for k in s.keys.values()]
    assert keys and shared.store.get(keys) == [None] * len(keys)
