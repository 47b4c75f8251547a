"""Scheduler and worker halves driven by hand, with a real memory-only store and no engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from halves_testlib import BS, CS, D, H, L, build_halves, compute, release
from halves_testlib import cached_step as _cached
from halves_testlib import fill as _fill
from halves_testlib import identity as _identity
from halves_testlib import kv as _kv
from halves_testlib import new_step as _new
from halves_testlib import request as _request
from halves_testlib import step as _step
from orbitkv.connector import runtime
from orbitkv.connector.scheduler.half import SchedulerHalf
from orbitkv.kernels.relocate import relocate

from orbitkv.config import OrbitKVConfig


def test_planning_is_side_effect_free_and_saves_follow_chunked_prefill(halves):
    sched, worker, caches, shared = halves
    tokens = list(range(10, 20))  # chunks [0,4) [4,8) [8,10)
    req = _request("a", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert not sched._reqs
    sched.update_state_after_alloc(req, None, 0)
    blocks = [3, 7, 5]
    _fill(caches, blocks, 10, seed=1)
    meta = sched.build_connector_meta(_new("a", blocks, 0, 6))  # chunked prefill: 6 tokens
    assert [s.start for s in meta.saves] == [0] and not meta.loads
    assert set(meta.saves[0].keys) == {"conditioned", "canonical"}  # first chunk: canonical too
    assert list(meta.saves[0].slots) == [12, 13, 14, 15]
    _step(worker, meta, caches)
    meta = sched.build_connector_meta(_cached("a", None, 6, 4))
    assert [s.start for s in meta.saves] == [4, 8]
    _step(worker, meta, caches)
    meta = sched.build_connector_meta(_cached("a", None, 10, 1))  # decode: nothing to save
    assert not meta.saves
    shared.writer.flush()
    _, summary = sched.request_finished(req, blocks)
    assert summary["orbitkv"]["num_saved_chunks"] == 3
    assert shared.store.stats()["puts"] == 4


def test_exact_then_survivor_load_round_trip(halves):
    sched, worker, caches, shared = halves
    sys_, c1, c2, q = [1] * 4, [2] * 4, [3] * 4, [9, 9]
    first = _request("first", sys_ + c1 + c2 + q)
    sched.get_num_new_matched_tokens(first, 0)
    sched.update_state_after_alloc(first, None, 0)
    blocks1 = [1, 2, 3, 4]
    _fill(caches, blocks1, 14, seed=2)
    _step(worker, sched.build_connector_meta(_new("first", blocks1, 0, 14)), caches)
    sched.request_finished(first, blocks1)

    second = _request("second", sys_ + c2 + q)
    # The save may still be on the writer thread: then the scheduler asks to be called again.
    num, is_async = sched.get_num_new_matched_tokens(second, 0)
    shared.writer.flush()
    num, is_async = sched.get_num_new_matched_tokens(second, 0)
    # sys exact; c2 and q survivors (their stored antecedents lose c1); q's last token computed.
    assert (num, is_async) == (9, False)
    sched.update_state_after_alloc(second, None, num)
    blocks2 = [10, 11, 12]
    meta = sched.build_connector_meta(_new("second", blocks2, 0, 1))
    assert [(s.mode, s.chunk_start, s.offset, len(s.slots)) for s in meta.loads] == [
        ("exact", 0, 0, 4),
        ("survivor", 4, 0, 4),
        ("survivor", 8, 0, 1),
    ]
    assert not meta.saves  # served chunks are never stored again
    _step(worker, meta, caches)
    got = _kv(caches, blocks2, 0, 8)
    want = _kv(caches, blocks1, 0, 4) + _kv(caches, blocks1, 8, 12)
    spec = _identity().rope
    for layer in range(L):
        assert torch.equal(got[layer][0][:4], want[layer][0])  # sys K as stored
        assert torch.equal(got[layer][1][4:], want[L + layer][1])  # c2 V unchanged
        moved = relocate(want[L + layer][0], -4, spec)
        assert torch.allclose(got[layer][0][4:], moved, atol=1e-6)
    _, summary = sched.request_finished(second, blocks2)
    assert summary["orbitkv"]["reused_tokens_by_mode"] == {"exact": 4, "survivor": 5}
    assert summary["orbitkv"]["approximate_from"] == 4 and summary["orbitkv"]["policy"]
    stats = worker.take_stats().reduce()
    assert stats["saved_chunks"] == 4 and stats.get("dropped_saves", 0) == 0
    # Whole entries fetched: sys (4 tokens), c2 (4) and q (2, stored as the first prompt's tail).
    assert stats["fetched_bytes"] == (4 + 4 + 2) * L * 2 * H * D * 4
    assert "loaded_tokens.exact" not in stats  # counted once, by the scheduler's ledger
    assert worker.take_stats() is None
    counted = sched.take_stats().reduce()
    assert counted["loaded_tokens.exact"] == 4 and counted["loaded_tokens.survivor"] == 5
    assert counted["loaded_bytes"] == 9 * L * 2 * H * D * 4  # fp32 K and V of 9 tokens


def test_blind_mode_serves_a_canonical_relocated_when_asked(halves):
    sched, worker, caches, shared = halves
    b, x = [6] * 4, [3] * 4
    first = _request("first", b + [1])  # b sits first: stored as canonical too
    sched.update_state_after_alloc(first, None, 0)
    _fill(caches, [1, 2], 5, seed=5)
    _step(worker, sched.build_connector_meta(_new("first", [1, 2], 0, 5)), caches)
    shared.writer.flush()
    sched.request_finished(first, [])
    # x then b: no conditioned entry of b reduces to (x,), so only the blind mode can serve b.
    later = _request("later", x + b + [1])
    assert sched.get_num_new_matched_tokens(later, 0) == (0, False)
    blind = _request("blind", x + b + [1], {"orbitkv": {"modes": {"blind": True}}})
    # x itself misses, so even blind b cannot be served: the run ends at the first miss.
    assert sched.get_num_new_matched_tokens(blind, 0) == (0, False)
    warm = _request("warm", x + [2])
    sched.update_state_after_alloc(warm, None, 0)
    _fill(caches, [3, 4], 5, seed=6)
    _step(worker, sched.build_connector_meta(_new("warm", [3, 4], 0, 5)), caches)
    shared.writer.flush()
    sched.request_finished(warm, [])
    assert sched.get_num_new_matched_tokens(blind, 0) == (8, False)
    sched.update_state_after_alloc(blind, None, 8)
    meta = sched.build_connector_meta(_new("blind", [5, 6, 7], 0, 1))
    assert [(s.mode, s.key.split(":")[1]) for s in meta.loads] == [
        ("exact", "conditioned"),
        ("blind", "canonical"),
    ]
    _step(worker, meta, caches)
    (k_got, v_got), (k_src, v_src) = _kv(caches, [5, 6], 4, 8)[0], _kv(caches, [1], 0, 4)[0]
    assert torch.allclose(k_got, relocate(k_src, 4, _identity().rope), atol=1e-6)
    assert torch.equal(v_got, v_src)


def test_load_errors_report_blocks_and_vllm_may_accept_fewer_tokens(halves):
    sched, worker, caches, shared = halves
    tokens = [5] * 4 + [6] * 4 + [7]
    a = _request("a", tokens)
    sched.update_state_after_alloc(a, None, 0)
    _fill(caches, [1, 2, 3], 9, seed=3)
    _step(worker, sched.build_connector_meta(_new("a", [1, 2, 3], 0, 9)), caches)
    shared.writer.flush()
    sched.request_finished(a, [])

    b = _request("b", tokens)
    assert sched.get_num_new_matched_tokens(b, 0) == (8, False)
    sched.update_state_after_alloc(b, None, 6)  # vLLM took fewer: the plan is cut to match
    meta = sched.build_connector_meta(_new("b", [20, 21, 22], 0, 3))
    assert [(s.offset, len(s.slots)) for s in meta.loads] == [(0, 4), (0, 2)]
    shared.store.delete([meta.loads[1].key])
    worker.start_load_kv(meta)
    assert worker.get_block_ids_with_load_errors() == {21}
    assert worker.get_block_ids_with_load_errors() == set()


def test_preempted_request_reloads_into_new_blocks_and_does_not_resave(halves):
    sched, worker, caches, shared = halves
    tokens = [4] * 4 + [8] * 4 + [1, 2]
    a = _request("a", tokens)
    sched.update_state_after_alloc(a, None, 0)
    _fill(caches, [1, 2, 3], 10, seed=4)
    meta = sched.build_connector_meta(_new("a", [1, 2, 3], 0, 10))
    assert len(meta.saves) == 3
    _step(worker, meta, caches)
    shared.writer.flush()
    # Preempted after two decode tokens, then resumed: planned again from scratch.
    a.num_tokens = 12
    assert sched.get_num_new_matched_tokens(a, 0) == (10, False)
    sched.update_state_after_alloc(a, None, 10)
    meta = sched.build_connector_meta(_cached("a", [9, 8, 7], 0, 2, is_resumed=True))
    assert [s.slots[0] for s in meta.loads] == [36, 32, 28]
    assert not meta.saves


def test_pending_saves_defer_planning(halves):
    sched, _, _, shared = halves
    req = _request("x", [1, 2, 3, 4, 5])
    cids = [c.cid for c in sched.admissions.chunks(req)[1]]
    shared.writer._pending.update(cids[:1])
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    shared.writer._pending.clear()
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_options_turn_load_and_save_off(halves):
    sched, _, _, _ = halves
    req = _request("o", [1] * 9, {"orbitkv": {"load": False, "save": False, "bogus": 1}})
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, None, 0)
    assert not sched.build_connector_meta(_new("o", [1, 2, 3], 0, 9)).saves


def test_unsupported_cache_is_a_clear_error(halves):
    _, worker, _, _ = halves
    worker._vllm_config.compilation_config.static_forward_context[
        "model.layers.0.self_attn.attn"
    ].isa = "amx"
    with pytest.raises(ValueError, match="amx"):
        worker.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(4, H, BS, 2 * D)})
    with pytest.raises((ValueError, TypeError)):
        worker._vllm_config.compilation_config.static_forward_context[
            "model.layers.0.self_attn.attn"
        ].isa = "vec"
        worker.register_kv_caches(
            {"model.layers.0.self_attn.attn": torch.zeros(4, H, BS, 2 * D, dtype=torch.float16)}
        )


def test_scheduler_in_another_process_learns_from_worker_reports(halves):
    """Scheduler and worker with separate stores, as with vLLM's multiprocess executor."""
    from orbitkv.store.tiered import TieredStore

    _, worker, caches, shared = halves
    config = OrbitKVConfig(chunk_size=CS, max_local_cpu_size=0.01, patch_rank=0, text_chunking="fixed",
                           save_admission="all")
    own_store = TieredStore.from_config(config)
    other = runtime.Shared(own_store, runtime.SaveWriter(own_store))
    vcfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS))
    sched = SchedulerHalf(vcfg, config, _identity(), other)
    sched.attach_scheduler()
    tokens = [2] * 4 + [3] * 4 + [1]
    a = _request("a", tokens)
    sched.update_state_after_alloc(a, None, 0)
    _fill(caches, [1, 2, 3], 9, seed=7)
    _step(worker, sched.build_connector_meta(_new("a", [1, 2, 3], 0, 9)), caches)
    sched.request_finished(a, [])
    b = _request("b", tokens)
    report = worker.build_worker_meta()  # saves queued; maybe already stored
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=report))
    if shared.writer.has_pending([c.cid for c in sched.admissions.chunks(b)[1]]):
        assert sched.get_num_new_matched_tokens(b, 0) == (None, False)
    shared.writer.flush()
    sched.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=worker.build_worker_meta())
    )
    assert sched.get_num_new_matched_tokens(b, 0) == (8, False)
    assert own_store.lookup([k for s in report.stored for k in [s.key]] or ["x"]) == [None] * max(
        1, len(report.stored)
    )
    runtime.release(other)


def test_tenants_do_not_share_entries():
    built = build_halves(request_tenants=("acme", "globex"))
    sched, worker, caches, shared = built
    try:
        tokens = [7] * 4 + [8] * 4 + [1]
        compute(built, "a", tokens, [1, 2, 3], seed=8, params={"orbitkv": {"tenant": "acme"}})
        same = _request("same", tokens, {"orbitkv": {"tenant": "acme"}})
        other = _request("other", tokens, {"orbitkv": {"tenant": "globex"}})
        # A salt named like the tenant is another isolation key.
        salted = _request("salted", tokens, cache_salt="acme")
        salted_tenant = _request("salted-tenant", tokens, {"orbitkv": {"tenant": "acme"}}, cache_salt="s1")
        assert sched.get_num_new_matched_tokens(same, 0) == (8, False)
        assert sched.get_num_new_matched_tokens(other, 0) == (0, False)
        assert sched.get_num_new_matched_tokens(salted, 0) == (0, False)
        assert sched.get_num_new_matched_tokens(salted_tenant, 0) == (0, False)
    finally:
        release(built)


def test_a_request_cannot_pick_a_tenant_the_deployment_did_not_allow(halves):
    """The tenant is the deployment's: a client naming another tenant neither reads nor writes
    under it (nor under the deployment's), and its summary says why."""
    sched, worker, caches, shared = halves
    tokens = [7] * 4 + [8] * 4 + [1]
    compute(halves, "a", tokens, [1, 2, 3], seed=8)
    intruder = _request("intruder", tokens, {"orbitkv": {"tenant": "acme"}})
    assert sched.get_num_new_matched_tokens(intruder, 0) == (0, False)
    sched.update_state_after_alloc(intruder, None, 0)
    assert not sched.build_connector_meta(_new("intruder", [4, 5, 6], 0, 9)).saves
    _, summary = sched.request_finished(intruder, [])
    assert "request_tenants" in summary["orbitkv"]["refused"]
    assert sched.take_stats().reduce()["refused_requests"] == 1


def test_patch_is_formed_against_the_canonical_and_served_when_the_entry_is_gone(patched_halves):
    sched, worker, caches, shared = patched_halves
    b, x = [6] * 4, [3] * 4
    compute(patched_halves, "canon", b + [1], [1, 2], seed=9)  # b first: its canonical
    meta = compute(patched_halves, "cond", x + b + [2], [3, 4, 5], seed=10)  # b after x: conditioned + patch
    b_save = next(s for s in meta.saves if s.start == 4)
    assert b_save.is_patch_wanted
    patch_key, orbit_key = worker._patches.keys(b_save.cid, b_save.antecedent)
    patch, orbit = shared.store.get([patch_key, orbit_key])
    assert patch is not None and patch.meta.rank == 8 and patch.meta.num_tokens == 4
    assert orbit is None  # one ordering seen: its own patch stands in for the orbit's
    # The store drops the conditioned entry; canonical + patch still rebuild KV(b | x).
    shared.store.delete([b_save.keys["conditioned"]])
    later = _request("later", x + b + [2])
    assert sched.get_num_new_matched_tokens(later, 0) == (8, False)
    sched.update_state_after_alloc(later, None, 8)
    meta = sched.build_connector_meta(_new("later", [6, 7, 8], 0, 1))
    assert [s.mode for s in meta.loads] == ["exact", "patched"]
    _step(worker, meta, caches)
    # Rank 8 >= 4 tokens: the patch captures the whole deficit, up to fp32 rounding.
    for (k_got, v_got), (k_want, v_want) in zip(
        _kv(caches, [6, 7], 4, 8), _kv(caches, [3, 4], 4, 8), strict=True
    ):
        assert torch.allclose(k_got, k_want, atol=1e-5)
        assert torch.allclose(v_got, v_want, atol=1e-5)
