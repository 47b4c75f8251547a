"""Patches on the connector halves (no engine): the orbit patch of a reordered set, patches formed
when the canonical lands after the conditioned entries, and stale patches never applied."""

from __future__ import annotations

import time

import halves_testlib
import torch
from halves_testlib import fill as _fill
from halves_testlib import kv as _kv
from halves_testlib import new_step as _new
from halves_testlib import request as _request
from halves_testlib import step as _step

B, X, Y = [6] * 4, [3] * 4, [5] * 4


def _compute(sched, worker, caches, shared, req_id, tokens, blocks, seed, params=None):
    return halves_testlib.compute((sched, worker, caches, shared), req_id, tokens, blocks, seed, params)


def _b_save(meta):
    return next(s for s in meta.saves if s.start == 8)  # b, after two 4-token chunks


def test_orbit_patch_serves_a_reordering_it_was_built_from(patched_halves):
    sched, worker, caches, shared = patched_halves
    _compute(sched, worker, caches, shared, "canon", B + [1], [1, 2], seed=1)
    xy = _compute(sched, worker, caches, shared, "xy", X + Y + B + [2], [3, 4, 5, 6], seed=2)
    yx = _compute(sched, worker, caches, shared, "yx", Y + X + B + [2], [7, 8, 9, 10], seed=3)
    b_xy, b_yx = _b_save(xy), _b_save(yx)
    assert b_xy.cid == b_yx.cid
    exact_xy, orbit = worker._patches.keys(b_xy.cid, b_xy.antecedent)
    exact_yx, orbit_yx = worker._patches.keys(b_yx.cid, b_yx.antecedent)
    assert orbit == orbit_yx and exact_xy != exact_yx
    p_xy, p_yx, p_orbit = shared.store.get([exact_xy, exact_yx, orbit])

    def product(p, side, layer):
        return p.tensors[f"u{side}.{layer}"] @ p.tensors[f"w{side}.{layer}"]

    for layer in range(2):
        for side in "kv":
            mean = (product(p_xy, side, layer) + product(p_yx, side, layer)) / 2
            assert torch.allclose(product(p_orbit, side, layer), mean, atol=1e-4)
    # The x.y entries and patch are gone: b after x.y is served from canonical + orbit patch.
    shared.store.delete([b_xy.keys["conditioned"], exact_xy])
    later = _request("later", X + Y + B + [2], {"orbitkv": {"modes": ["exact", "orbit"]}})
    assert sched.get_num_new_matched_tokens(later, 0) == (12, False)
    sched.update_state_after_alloc(later, None, 12)
    meta = sched.build_connector_meta(_new("later", [11, 12, 13, 14], 0, 1))
    assert [s.mode for s in meta.loads] == ["exact", "exact", "orbit"]
    _step(worker, meta, caches)
    # Rank 8 >= 4 tokens: canonical + the mean deficit, relocated, up to fp32 rounding.
    got = _kv(caches, [13], 0, 4)
    want_xy = _kv(caches, [5], 0, 4)
    want_yx = _kv(caches, [9], 0, 4)
    for (k_got, v_got), (k_xy, v_xy), (_, v_yx) in zip(got, want_xy, want_yx, strict=True):
        # V has no RoPE: canonical + mean(V_xy - V_can, V_yx - V_can) = mean(V_xy, V_yx).
        assert torch.allclose(v_got, (v_xy + v_yx) / 2, atol=1e-4)
        assert not torch.allclose(k_got, k_xy, atol=1e-3)  # an approximation, not x.y's KV


def test_a_set_seen_in_one_order_is_served_reordered_by_that_order_s_patch(patched_halves):
    """b after x.y only: no orbit entry is stored, and b after y.x is served ``orbit`` from x.y's
    own patch (V: exactly x.y's, up to fp32 rounding: the patch is full rank). A second ordering
    then stores the orbit entry, the mean of both."""
    sched, worker, caches, shared = patched_halves
    _compute(sched, worker, caches, shared, "canon", B + [1], [1, 2], seed=11)
    xy = _compute(sched, worker, caches, shared, "xy", X + Y + B + [2], [3, 4, 5, 6], seed=12)
    own, orbit = worker._patches.keys(_b_save(xy).cid, _b_save(xy).antecedent)
    assert shared.store.lookup([own, orbit]) == ["memory", None]
    _compute(sched, worker, caches, shared, "y.x", Y + X + [2], [15, 16, 17], seed=14)  # not b
    later = _request("yx", Y + X + B + [2], {"orbitkv": {"modes": ["exact", "orbit"]}})
    assert sched.get_num_new_matched_tokens(later, 0) == (12, False)
    sched.update_state_after_alloc(later, None, 12)
    meta = sched.build_connector_meta(_new("yx", [7, 8, 9, 10], 0, 1))
    assert [(s.mode, s.patch_key) for s in meta.loads][-1] == ("orbit", own)
    _step(worker, meta, caches)
    for (_, v_got), (_, v_xy) in zip(_kv(caches, [9], 0, 4), _kv(caches, [5], 0, 4), strict=True):
        assert torch.allclose(v_got, v_xy, atol=1e-4)
    sched.request_finished(later, [7, 8, 9, 10])
    _compute(sched, worker, caches, shared, "yx2", Y + X + B + [2], [11, 12, 13, 14], seed=13)
    assert shared.store.lookup([orbit]) == ["memory"]


def test_patches_formed_when_the_canonical_lands_later(patched_halves):
    sched, worker, caches, shared = patched_halves
    xb = _compute(sched, worker, caches, shared, "xb", X + B + [2], [1, 2, 3], seed=4)
    b_save = next(s for s in xb.saves if s.start == 4)
    exact, orbit = worker._patches.keys(b_save.cid, b_save.antecedent)
    assert shared.store.lookup([exact, orbit]) == [None, None]  # no canonical yet: no patch
    _compute(sched, worker, caches, shared, "canon", B + [1], [4, 5], seed=5)
    # One ordering seen: no orbit entry (a copy of this ordering's patch would take its bytes).
    assert shared.store.lookup([exact, orbit]) == ["memory", None]
    (patch,) = shared.store.get([exact])
    assert patch.meta.antecedent == b_save.antecedent and patch.meta.rank == 8


def test_an_exact_only_server_forms_no_patch_when_the_canonical_lands():
    """approximate_reuse off: no request can read a patch, so the canonical queues no job (the
    same flow as above forms one with approximate reuse on)."""
    built = halves_testlib.build_halves(patch_rank=8, approximate_reuse="off")
    sched, worker, caches, shared = built
    try:
        xb = _compute(sched, worker, caches, shared, "xb", X + B + [2], [1, 2, 3], seed=4)
        b_save = next(s for s in xb.saves if s.start == 4)
        canon = _compute(sched, worker, caches, shared, "canon", B + [1], [4, 5], seed=5)
        assert any("canonical" in s.keys for s in canon.saves)  # the canonical is still saved
        shared.writer.patches.flush(timeout_s=10)
        exact, orbit = worker._patches.keys(b_save.cid, b_save.antecedent)
        assert shared.store.lookup([exact, orbit]) == [None, None]
        assert shared.writer.patches.num_formed == 0
    finally:
        halves_testlib.release(built)


def test_a_stale_patch_is_never_applied_to_another_antecedent(patched_halves):
    sched, worker, caches, shared = patched_halves
    _compute(sched, worker, caches, shared, "canon", B + [1], [1, 2], seed=6)
    xb = _compute(sched, worker, caches, shared, "xb", X + B + [2], [3, 4, 5], seed=7)
    yb = _compute(sched, worker, caches, shared, "yb", Y + B + [2], [6, 7, 8], seed=8)
    b_x = next(s for s in xb.saves if s.start == 4)
    b_y = next(s for s in yb.saves if s.start == 4)
    exact_x, _ = worker._patches.keys(b_x.cid, b_x.antecedent)
    exact_y, _ = worker._patches.keys(b_y.cid, b_y.antecedent)
    # y's patch slot now holds x's bytes (a stale or misfiled copy), and y's entry is gone.
    (raw_x,) = shared.store.get_bytes([exact_x])
    shared.store.delete([exact_y, b_y.keys["conditioned"]])
    shared.store.put_bytes([(exact_y, bytes(raw_x))])
    later = _request("later", Y + B + [2], {"orbitkv": {"modes": ["exact", "patched"]}})
    assert sched.get_num_new_matched_tokens(later, 0) == (8, False)  # planned: the key exists
    sched.update_state_after_alloc(later, None, 8)
    meta = sched.build_connector_meta(_new("later", [9, 10, 11], 0, 1))
    assert [s.mode for s in meta.loads] == ["exact", "patched"]
    _fill(caches, [10], 4, seed=99)  # what sits in b's slots if nothing is written
    before = _kv(caches, [10], 0, 4)
    worker.start_load_kv(meta)
    failed = worker.get_block_ids_with_load_errors()
    assert failed == {10}  # refused at fetch: vLLM recomputes that block
    for name in caches:
        worker.wait_for_layer_load(name)
    for (k0, v0), (k1, v1) in zip(before, _kv(caches, [10], 0, 4), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)  # never applied


def test_a_smaller_patch_replaces_the_conditioned_entry_when_the_deployment_says_so():
    """patch_replaces_conditioned + bf16 factors: once B-after-X's patch is stored, the exact entry
    KV(B|X) goes; B after X is then served canonical + patch (approximate), and an exact-only
    request computes it. Without the knob the exact entry stays."""
    import halves_testlib

    for is_replacing in (True, False):
        built = halves_testlib.build_halves(
            patch_rank=2, patch_dtype="bfloat16", patch_replaces_conditioned=is_replacing
        )
        sched, worker, caches, shared = built
        try:
            _compute(sched, worker, caches, shared, "canon", B + [1], [1, 2], seed=20)
            meta = _compute(sched, worker, caches, shared, "xb", X + B + [2], [3, 4, 5], seed=21)
            b = _b_after_x(meta)
            patch_key, _ = worker._patches.keys(b.cid, b.antecedent)
            (patch,) = shared.store.get([patch_key])
            assert patch is not None and patch.tensors["uk.0"].dtype == torch.bfloat16
            is_kept = shared.store.lookup([b.keys["conditioned"]])[0] is not None
            assert is_kept is not is_replacing
            later = _request("later", X + B + [2])
            assert sched.get_num_new_matched_tokens(later, 0) == (8, False)
            sched.update_state_after_alloc(later, None, 8)
            loads = sched.build_connector_meta(_new("later", [6, 7, 8], 0, 1)).loads
            assert [s.mode for s in loads] == ["exact", "patched" if is_replacing else "exact"]
            exact_only = _request("exact", X + B + [2], {"orbitkv": {"modes": ["exact"]}})
            want = 8 if not is_replacing else 4
            assert sched.get_num_new_matched_tokens(exact_only, 0) == (want, False)
        finally:
            halves_testlib.release(built)


def _saved_unflushed(built, req_id, tokens, blocks, seed):
    """One request computed whole whose saves reached the store; its patch jobs may still wait."""
    shared = built[3]
    _, meta = halves_testlib.computed_step(built, req_id, tokens, blocks, seed)
    deadline = time.monotonic() + 10
    while shared.writer.has_pending([s.cid for s in meta.saves]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not shared.writer.has_pending([s.cid for s in meta.saves])
    return meta


def test_a_conditioned_entry_its_patch_replaces_is_never_stored():
    """With the canonical stored, B-after-X's conditioned entry waits with its patch job instead
    of taking the store's bytes until the patch forms (stored then deleted, it evicted older
    entries in the meantime: ``bench bytes``). It is stored after all when the patch is not
    smaller than it, or when the queue drops the job; its antecedent is indexed either way."""
    import halves_testlib

    for case in ("replaced", "not smaller", "dropped"):
        rank, overrides = 2, {"patch_dtype": "bfloat16", "patch_replaces_conditioned": True}
        if case == "not smaller":  # full rank over 4 tokens in fp32: more bytes than the KV
            rank, overrides["patch_dtype"] = 4, "float32"
        if case == "dropped":
            overrides["patch_queue_depth"] = 1
        built = halves_testlib.build_halves(patch_rank=rank, **overrides)
        sched, worker, caches, shared = built
        try:
            _compute(sched, worker, caches, shared, "canon", B + [1], [1, 2], seed=30)
            queue = shared.writer.patches
            with halves_testlib.held_patches(queue):
                if case == "dropped":
                    queue.submit(lambda: [])  # the queue's one place taken
                meta = _saved_unflushed(built, "xb", X + B + [2], [3, 4, 5], seed=31)
                b = _b_after_x(meta)
                stored_now = shared.store.lookup([b.keys["conditioned"]])[0] is not None
                assert stored_now is (case == "dropped"), case
            shared.writer.flush()
            patch_key, _ = worker._patches.keys(b.cid, b.antecedent)
            has_patch = shared.store.lookup([patch_key])[0] is not None
            has_conditioned = shared.store.lookup([b.keys["conditioned"]])[0] is not None
            assert has_patch is (case != "dropped"), case
            assert has_conditioned is (case != "replaced"), case
            (seen,) = shared.store.batch_antecedents([b.cid])
            assert tuple(b.antecedent) in [tuple(a) for a in seen], case
        finally:
            halves_testlib.release(built)


def _b_after_x(meta):
    return next(s for s in meta.saves if s.start == 4)
