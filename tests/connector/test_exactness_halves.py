"""Exact stays exact, on the connector halves (no engine): lineage of saves, failed loads,
canonicals and patches, who may receive approximate KV. vLLM's own prefix cache is covered by
``test_vllm_exactness.py``."""

from __future__ import annotations

import torch
from halves_testlib import build_halves, compute, fill, kv, new_step, release, request, step
from orbitkv.store.keys import EntryKey

SYS, C1, C2, C3, Q = [1] * 4, [2] * 4, [3] * 4, [4] * 4, [9, 9]


def _admit(sched, req, blocks, num_sched):
    """Admit ``req`` with nothing in vLLM's prefix cache; this step computes ``num_sched`` tokens
    after what OrbitKV loads."""
    num, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, num or 0)
    return sched.build_connector_meta(new_step(req.request_id, blocks, num or 0, num_sched)), num


def _kinds(meta):
    return [(s.start, sorted(s.keys), s.lineage != "") for s in meta.saves]


def test_chunks_computed_behind_approximate_kv_are_saved_under_the_policy(halves):
    """[sys, c1, c2, c3] then [sys, c2, c3, c4]: c2 and c3 are survivors, so c4 is computed over
    approximate KV: it is saved as an approximate entry of that request's policy, never exact,
    and neither an exact request nor another policy is ever served it."""
    sched, worker, caches, shared = halves
    compute(halves, "first", SYS + C1 + C2 + C3 + Q, [1, 2, 3, 4, 5], seed=1)
    second = request("second", SYS + C2 + C3 + [5] * 4 + Q)
    meta, num = _admit(sched, second, [6, 7, 8, 9, 10], 18 - 12)
    assert num == 12 and [s.mode for s in meta.loads] == ["exact", "survivor", "survivor"]
    fill(caches, [6, 7, 8, 9, 10], 18, seed=2)
    step(worker, meta, caches)
    shared.writer.flush()
    assert _kinds(meta) == [(12, ["conditioned"], True), (16, ["conditioned"], True)]
    c4 = meta.saves[0]
    key = EntryKey.parse(c4.keys["conditioned"])
    assert not key.is_exact and key.lineage == second_policy(sched, second)
    _, summary = sched.request_finished(second, [])
    assert summary["orbitkv"]["approximate_from"] == 4
    # The same prompt later: exact-only gets none of the approximate chunks.
    exact = request("exact", SYS + C2 + C3 + [5] * 4 + Q, {"orbitkv": {"modes": ["exact"]}})
    assert sched.get_num_new_matched_tokens(exact, 0) == (4, False)
    # Under the same policy: survivors again, then c4's inherited entry (approximate).
    again = request("again", SYS + C2 + C3 + [5] * 4 + Q)
    meta, num = _admit(sched, again, [11, 12, 13, 14, 15], 1)
    assert [s.mode for s in meta.loads] == ["exact", "survivor", "survivor", "inherited", "inherited"]
    assert meta.loads[3].key == c4.keys["conditioned"]


def second_policy(sched, req):
    return sched.admissions.chunks(req)[0].policy.tag


def test_an_exact_plan_never_produces_an_approximate_save(halves):
    sched, worker, caches, shared = halves
    compute(halves, "first", SYS + C1 + Q, [1, 2, 3], seed=3)
    exact = request("x", SYS + C1 + C2 + Q, {"orbitkv": {"modes": ["exact"]}})
    meta, num = _admit(sched, exact, [4, 5, 6, 7], 18 - 8)
    assert num == 8 and {s.mode for s in meta.loads} == {"exact"}
    assert _kinds(meta) == [(8, ["conditioned"], False), (12, ["conditioned"], False)]


def test_nothing_computed_over_a_failed_load_is_saved_until_recomputed(halves):
    """The load of c1 fails in the step that also computes c2 over c1's unwritten blocks: c2 is
    not saved then; once vLLM recomputes from c1's block, c1 and c2 are saved as computed."""
    sched, worker, caches, shared = halves
    compute(halves, "first", SYS + C1 + Q, [1, 2, 3], seed=4)
    req = request("r", SYS + C1 + C2 + Q)  # 14 tokens, 4 blocks
    meta, num = _admit(sched, req, [4, 5, 6, 7], 14 - 8)
    assert num == 8
    c1_key = meta.loads[1].key
    shared.store.delete([c1_key])  # evicted between planning and loading
    fill(caches, [4, 5, 6, 7], 14, seed=5)
    step(worker, meta, caches)
    assert worker.get_block_ids_with_load_errors() == {5}
    shared.writer.flush()
    c2_key = meta.saves[0].keys["conditioned"]
    assert [s.start for s in meta.saves] == [8, 12]
    assert shared.store.lookup([c2_key]) == [None]  # computed over garbage: not saved
    assert worker.take_stats().reduce()["unsafe_saves_skipped"] == 2
    # vLLM (the scheduler extension) truncates the request at block 5 = token 4.
    sched.on_recompute("r", 4)
    redo = sched.build_connector_meta(_cached("r", 4, 14 - 4))
    assert redo.recovered == ["r"]
    fill(caches, [4, 5, 6, 7], 14, seed=6)
    step(worker, redo, caches)
    shared.writer.flush()
    assert [s.start for s in redo.saves] == [4, 8, 12]
    assert all(s.lineage == "" for s in redo.saves)
    assert shared.store.lookup([c1_key, c2_key]) == ["memory", "memory"]
    _, summary = sched.request_finished(req, [])
    assert summary["orbitkv"]["num_reused_tokens"] == 4
    assert summary["orbitkv"]["num_failed_load_tokens"] == 4


def _cached(req_id, num_computed, num_sched):
    from halves_testlib import cached_step

    return cached_step(req_id, None, num_computed, num_sched)


def test_requests_that_skip_the_prefix_cache_get_nothing_loaded(halves):
    """vLLM serves a request that needs prompt logprobs nothing cached; OrbitKV neither (no
    prefix run, no hole: its logprobs must be computed for every prompt token)."""
    sched, worker, caches, shared = halves
    compute(halves, "first", SYS + C1 + C2 + Q, [1, 2, 3, 4], seed=7)
    req = request("logprobs", SYS + C1 + C2 + Q)
    req.skip_reading_prefix_cache = True
    sched.enable_holes(1)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, None, 0)
    assert sched.hole_cap("logprobs", 0, 18, is_admission=True) == 18
    assert not sched.build_connector_meta(new_step("logprobs", [5, 6, 7, 8], 0, 18)).loads


def test_a_canonical_is_saved_once_and_canonicalize_never_overwrites_it(halves):
    sched, worker, caches, shared = halves
    meta = compute(halves, "a", C1 + Q, [1, 2], seed=8)
    assert sorted(meta.saves[0].keys) == ["canonical", "conditioned"]
    canonical = meta.saves[0].keys["canonical"]
    (first,) = shared.store.get([canonical])
    meta = compute(halves, "b", C1 + [7, 7], [3, 4], seed=9)  # same chunk first again
    assert meta.saves == [] or all("canonical" not in s.keys for s in meta.saves)
    assert shared.store.get([canonical])[0].meta.checksum == first.meta.checksum


def test_a_patch_is_applied_only_to_the_canonical_it_was_formed_against():
    built = build_halves(patch_rank=8)
    sched, worker, caches, shared = built
    try:
        b, x = [6] * 4, [3] * 4
        compute(built, "canon", b + [1], [1, 2], seed=10)
        meta = compute(built, "xb", x + b + [2], [3, 4, 5], seed=11)
        b_save = next(s for s in meta.saves if s.start == 4)
        patch_key, _ = worker._patches.keys(b_save.cid, b_save.antecedent)
        (patch,) = shared.store.get([patch_key])
        (canonical,) = shared.store.get([b_save.canonical_key])
        assert patch.meta.canonical_checksum == canonical.meta.checksum
        # Another canonical now sits under the key (another writer's forward of the same chunk).
        other = type(canonical)(canonical.meta, {n: t + 1 for n, t in canonical.tensors.items()})
        shared.store.delete([b_save.keys["conditioned"], b_save.canonical_key])
        shared.store.put(b_save.canonical_key, _rebuilt(other))
        later = request("later", x + b + [2], {"orbitkv": {"modes": ["exact", "patched"]}})
        meta, num = _admit(sched, later, [6, 7, 8], 1)
        assert num == 8 and [s.mode for s in meta.loads] == ["exact", "patched"]
        fill(caches, [7], 4, seed=12)
        before = kv(caches, [7], 0, 4)
        worker.start_load_kv(meta)
        assert worker.get_block_ids_with_load_errors() == {7}
        for name in caches:
            worker.wait_for_layer_load(name)
        for (k0, v0), (k1, v1) in zip(before, kv(caches, [7], 0, 4), strict=True):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
    finally:
        release(built)


def _rebuilt(entry):
    from orbitkv.store.entry import make_entry

    m = entry.meta
    return make_entry(m.kind, entry.tensors, model_fingerprint=m.model_fingerprint, layout=m.layout,
                      start_pos=m.start_pos, rope_hash=m.rope_hash, antecedent=m.antecedent)


def test_a_salt_does_not_opt_in_a_request_does():
    """approximate_reuse: request: exact for every request, salted or not, unless it opts in with
    ``approximate: true`` (naming approximate modes is not opting in); off: never."""
    opt_in = {"orbitkv": {"approximate": True}}
    for reuse, opted_tokens in (("request", 9), ("off", 4)):
        built = build_halves(approximate_reuse=reuse)
        sched = built[0]
        try:
            compute(built, "first", SYS + C1 + C2 + Q, [1, 2, 3, 4], seed=13, cache_salt="u1")
            salted = request("x", SYS + C2 + Q, cache_salt="u1")
            assert sched.get_num_new_matched_tokens(salted, 0) == (4, False)  # sys only: exact
            assert sched.admissions.chunks(salted)[0].policy.is_exact
            named = request("y", SYS + C2 + Q, {"orbitkv": {"modes": ["exact", "survivor"]}},
                            cache_salt="u1")
            assert sched.get_num_new_matched_tokens(named, 0) == (4, False)
            opted = request("z", SYS + C2 + Q, opt_in, cache_salt="u1")
            assert sched.get_num_new_matched_tokens(opted, 0) == (opted_tokens, False)
            assert sched.admissions.chunks(opted)[0].policy.is_exact == (reuse == "off")
        finally:
            release(built)


def test_without_the_scheduler_extension_nothing_is_loaded():
    built = build_halves(is_attached=False)
    sched, worker, caches, shared = built
    try:
        compute(built, "first", SYS + C1 + Q, [1, 2, 3], seed=15)
        assert shared.store.lookup([k for s in [] for k in s] or ["x"]) == [None]
        again = request("again", SYS + C1 + Q)
        assert sched.get_num_new_matched_tokens(again, 0) == (0, False)
    finally:
        release(built)
