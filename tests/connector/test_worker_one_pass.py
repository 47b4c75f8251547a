"""The worker half loads every layer at the step's first ``wait_for_layer_load`` and gathers every
layer's saves at ``wait_for_save``: one pass a step, not one per layer (``worker/half.py``); saves
need no per-layer hook at all, and a forward that raised saves nothing."""

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
def test_saves_gather_every_layer_after_the_forward(halves, monkeypatch, is_native):
    """One native gather for every layer, or (no native op, a GPU cache) one gather per layer;
    vLLM calls no per-layer hook in a step that only saves."""
    from orbitkv.kernels import paged_native

    monkeypatch.setattr(paged_native, "is_enabled", is_native)
    sched, worker, caches, shared = halves
    meta = _computing_step(sched, caches, seed=2)
    assert meta.saves
    expected = kv(caches, [1, 2, 3], 0, 10)
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    shared.writer.flush()
    for spec in meta.saves:
        # The entry as computed here (a canonical is stored at position 0: rotated).
        (entry,) = shared.store.get([spec.keys["conditioned"]])
        assert entry is not None and entry.meta.start_pos == spec.start
        for li, (k, v) in enumerate(expected):
            assert torch.equal(entry.tensors[f"k.{li}"], k[spec.start : spec.end])
            assert torch.equal(entry.tensors[f"v.{li}"], v[spec.start : spec.end])


def _stored(shared, meta) -> list:
    shared.writer.flush()
    return shared.store.get([k for s in meta.saves for k in s.keys.values()])


def test_the_saves_of_a_forward_that_raised_are_skipped_and_counted(halves):
    sched, worker, caches, shared = halves
    meta = _computing_step(sched, caches, seed=3)
    assert meta.saves
    worker.start_load_kv(meta)
    worker.wait_for_save(meta, is_forward_complete=False)
    assert _stored(shared, meta) == [None] * sum(len(s.keys) for s in meta.saves)
    assert worker.take_stats().data["incomplete_saves_skipped"] == len(meta.saves)


def _connector_on(worker, meta):
    """The connector's worker side around a real worker half (no engine behind it)."""
    from orbitkv.connector.connector import OrbitKVConnector
    from orbitkv.connector.timing import PartSeconds

    conn = object.__new__(OrbitKVConnector)
    conn._worker, conn._scheduler, conn._seconds = worker, None, PartSeconds()
    conn._connector_metadata = meta
    return conn


def test_the_connector_tells_a_forward_that_raised_by_the_exception_in_flight(halves):
    """vLLM calls ``wait_for_save`` in the ``finally`` around the forward: with an exception
    propagating, nothing is saved; after a forward that returned, everything is."""
    sched, worker, caches, shared = halves
    failed = _computing_step(sched, caches, seed=4)
    conn = _connector_on(worker, failed)
    worker.start_load_kv(failed)
    with pytest.raises(RuntimeError, match="forward"):
        try:
            raise RuntimeError("the forward stopped at layer 1")
        finally:
            conn.wait_for_save()
    assert _stored(shared, failed) == [None] * sum(len(s.keys) for s in failed.saves)
    done = step_meta(sched, caches, "b", [3] * 4 + C1 + Q, [4, 5, 6], 5)
    assert done.saves
    conn = _connector_on(worker, done)
    worker.start_load_kv(done)
    conn.wait_for_save()
    assert all(e is not None for e in _stored(shared, done))


def test_caches_that_are_not_the_models_layers_once_each_save_nothing(halves):
    """A cache per model layer is what a save copies; with one layer missing (a pipeline stage,
    shared KV layers) nothing is saved, and the skipped saves are counted."""
    sched, worker, caches, shared = halves
    first = next(iter(caches))
    worker.register_kv_caches({first: caches[first]})
    meta = _computing_step(sched, caches, seed=6)
    assert meta.saves
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    assert _stored(shared, meta) == [None] * sum(len(s.keys) for s in meta.saves)
    assert worker.take_stats().data["incomplete_saves_skipped"] == len(meta.saves)
