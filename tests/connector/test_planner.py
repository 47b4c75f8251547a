"""Planner: mode choice and the served run, against a dict-backed store view (``planner_testlib``)."""

from __future__ import annotations

from orbitkv.connector.scheduler.planner import (
    BLIND,
    EXACT,
    INHERITED,
    MISS,
    PATCHED,
    SURVIVOR,
    TRANSFER,
    TRANSFER_ATTACHED,
    plan_request,
)
from orbitkv.connector.scheduler.relocation import (
    common_length,
    is_subsequence,
    survivor_candidates,
    transfer_candidates,
)
from orbitkv.store.keys import (
    RequestKeys,
    antecedent_hash,
    canonical_key,
    conditioned_key,
    patch_key,
)
from planner_testlib import DictView, P, Q, make_chunks, mode_summary


def test_subsequence_and_candidates():
    assert is_subsequence(("a", "c"), ("a", "b", "c"))
    assert not is_subsequence(("c", "a"), ("a", "b", "c"))
    assert is_subsequence((), ("x",))
    cands = survivor_candidates(("a",), [("a", "b", "c"), ("a", "b"), ("a",), ("b",)])
    assert cands == [("a", "b"), ("a", "b", "c")]


def test_common_length_is_the_longest_common_subsequence():
    assert common_length("sxab", "scab") == 3
    assert common_length("abc", "cab") == 2
    assert common_length("aab", "aba") == 2  # a repeated chunk
    assert common_length("", "abc") == 0 and common_length("xy", "abc") == 0


def test_transfer_candidates_are_the_closest_other_stored_antecedents():
    current = ("s", "c", "a", "b")
    stored = [("s", "a"), ("s",), (), ("s", "a", "b"), ("s", "b", "a"), ("x",), current,
              ("s", "c", "a", "b", "d"), ("s", "0", "1", "a")]
    # Fewest chunks inserted or removed first: (s, a, b) lacks c; (s, b, a) and (s, a) lack c
    # and one more; (s,) lacks three; (s, 0, 1, a) shares two and has two more. Never the empty
    # antecedent or one sharing nothing (as far as the blind canonical), the exact entry's own,
    # or a survivor's (s, c, a, b, d).
    assert transfer_candidates(current, stored) == [
        ("s", "a", "b"), ("s", "a"), ("s", "b", "a"), ("s",)
    ]
    assert transfer_candidates((), stored) == []


def test_rotated_window_uses_transfers_only_where_allowed():
    first = make_chunks(10, 1, 2, 3, tail=[7])  # [sys, c1, c2, c3, q1]
    rotated = make_chunks(10, 3, 1, 2, tail=[8])  # [sys, c3, c1, c2, q2]
    view = DictView.holding(first)
    sys_cid, c1_cid = first[0].cid, first[1].cid
    allowed = {EXACT, SURVIVOR, TRANSFER}
    plan = plan_request(
        rotated, view, num_computed_tokens=0, num_tokens=17, modes=allowed,
        keys=RequestKeys(lineage=P),
    )
    assert [(i.mode, i.begin, i.end) for i in plan.loads] == [
        (EXACT, 0, 4),
        (SURVIVOR, 4, 8),  # c3 was behind (sys, c1, c2): chunks removed
        (TRANSFER, 8, 12),  # c1 was behind (sys): c3 inserted
        (TRANSFER, 12, 16),  # c2 was behind (sys, c1): c3 inserted
    ]
    assert plan.decision(2).source_antecedent == (sys_cid,)
    assert plan.decision(3).source_antecedent == (sys_cid, c1_cid)
    assert plan.first_approximate_token == 4
    assert view.num_calls == 3
    # Off by default: survivors only, and the run ends at c1. An exact request: sys only.
    plan = plan_request(
        rotated, view, num_computed_tokens=0, num_tokens=17, keys=RequestKeys(lineage=P),
    )
    assert [i.mode for i in plan.loads] == [EXACT, SURVIVOR]
    plan = plan_request(rotated, view, num_computed_tokens=0, num_tokens=17, modes=allowed)
    assert [i.mode for i in plan.loads] == [EXACT] and plan.first_approximate_token is None
    # Chunks removed and inserted: c1 was computed behind (sys, c0), now behind (sys, c2).
    view = DictView.holding((*make_chunks(10, 0, 1), *make_chunks(10, 2)))
    turned = make_chunks(10, 2, 1, tail=[9])
    plan = plan_request(
        turned, view, num_computed_tokens=0, num_tokens=13, modes=allowed,
        keys=RequestKeys(lineage=P),
    )
    assert [i.mode for i in plan.loads] == [EXACT, EXACT, TRANSFER]
    assert plan.decision(2).source_antecedent == (sys_cid, make_chunks(10, 0)[1].cid)


def test_attached_text_transfers_only_behind_the_chunk_it_followed():
    """``transfer_attached_modalities``: an observation moved with its screenshot transfers from
    its old window (it follows the same chunk there); the question, now behind another chunk,
    does not, and the run ends there. Images transfer from anywhere (c1 from behind sys)."""
    images = {make_chunks(1)[0].cid, make_chunks(2)[0].cid}
    every = frozenset({EXACT, SURVIVOR, TRANSFER})

    def modes_for(chunk):  # c1, c2 are the images; the rest is text, attached-only
        return every if chunk.cid in images else every - {TRANSFER} | {TRANSFER_ATTACHED}

    first = make_chunks(10, 1, 5, 2, 6, 7, tail=[9])  # [sys, c1, o1, c2, o2, q]
    moved = make_chunks(10, 2, 6, 1, 5, 7, tail=[9])  # [sys, c2, o2, c1, o1, q]
    view = DictView.holding(first)
    plan = plan_request(
        moved, view, num_computed_tokens=0, num_tokens=25, modes=every, mode_filter=modes_for,
        keys=RequestKeys(lineage=P),
    )
    assert [i.mode for i in plan.loads] == [EXACT, SURVIVOR, SURVIVOR, TRANSFER, TRANSFER]
    assert plan.decision(4).source_antecedent == (first[0].cid, first[1].cid)  # o1 behind c1
    assert plan.decision(5).mode == MISS  # q: behind o2 then, behind o1 now
    # Text out of transfer's scope: o1 is computed, and the run ends at c1.
    plan = plan_request(
        moved, view, num_computed_tokens=0, num_tokens=25, modes=every,
        mode_filter=lambda c: every if c.cid in images else every - {TRANSFER},
        keys=RequestKeys(lineage=P),
    )
    assert [i.mode for i in plan.loads] == [EXACT, SURVIVOR, SURVIVOR, TRANSFER]
    # A request without transfer gets none of it, attached or not.
    plan = plan_request(
        moved, view, num_computed_tokens=0, num_tokens=25, modes=every - {TRANSFER},
        mode_filter=modes_for, keys=RequestKeys(lineage=P),
    )
    assert TRANSFER not in {i.mode for i in plan.loads}


def test_a_patch_for_this_antecedent_beats_a_transfer():
    first = make_chunks(10, 1, tail=[7])
    moved = make_chunks(10, 2, 1, tail=[8])  # c1 now behind (sys, c2)
    view = DictView.holding(first)
    view.add_conditioned(moved[1])
    c1 = moved[2]
    modes = {EXACT, TRANSFER, PATCHED}
    plan = plan_request(
        moved, view, num_computed_tokens=0, num_tokens=13, modes=modes,
        keys=RequestKeys(patch_rank=8, lineage=P),
    )
    assert plan.decision(2).mode == TRANSFER
    assert plan.decision(2).key == conditioned_key(c1.cid, first[1].antecedent_hash)
    canon = canonical_key(c1.cid, "")
    view.add(canon)
    view.add(patch_key(c1.cid, c1.antecedent_hash, 8))
    plan = plan_request(
        moved, view, num_computed_tokens=0, num_tokens=13, modes=modes,
        keys=RequestKeys(patch_rank=8, lineage=P),
    )
    assert plan.decision(2).mode == PATCHED and plan.decision(2).key == canon
    # An entry computed under this policy transfers too; under another policy it does not.
    view2 = DictView()
    view2.add_conditioned(first[0])
    view2.add_conditioned(moved[1])
    view2.add_conditioned(first[1], lineage=P)
    plan = plan_request(
        moved, view2, num_computed_tokens=0, num_tokens=13, modes=modes,
        keys=RequestKeys(lineage=P),
    )
    assert plan.decision(2).mode == TRANSFER and plan.decision(2).key.endswith(":l" + P)
    plan = plan_request(
        moved, view2, num_computed_tokens=0, num_tokens=13, modes=modes,
        keys=RequestKeys(lineage=Q),
    )
    assert plan.decision(2).mode == MISS


def test_exact_repeat_serves_all_but_last_token():
    chunks = make_chunks(1, 2, 3)
    view = DictView.holding(chunks)
    plan = plan_request(chunks, view, num_computed_tokens=0, num_tokens=12)
    assert plan.num_external_tokens == 11
    assert [(i.begin, i.end, i.mode) for i in plan.loads] == [
        (0, 4, EXACT),
        (4, 8, EXACT),
        (8, 11, EXACT),
    ]
    assert mode_summary(plan) == {EXACT: 11}


def test_run_extends_computed_prefix_and_stops_at_first_miss():
    chunks = make_chunks(1, 2, 3, 4, tail=[9])
    view = DictView.holding((chunks[0], chunks[1], chunks[3]))
    plan = plan_request(chunks, view, num_computed_tokens=2, num_tokens=17)
    assert [(i.chunk_index, i.begin, i.end) for i in plan.loads] == [(0, 2, 4), (1, 4, 8)]
    assert plan.num_external_tokens == 6
    assert plan.decision(2).mode == MISS and plan.decision(3).mode == EXACT
    # Nothing computed yet and the first chunk missing: nothing to load.
    other = make_chunks(5, 2, 3)
    plan = plan_request(other, view, num_computed_tokens=0, num_tokens=12)
    assert plan.num_external_tokens == 0


def test_sliding_window_uses_survivors():
    first = make_chunks(10, 1, 2, 3, tail=[7])  # [sys, c1, c2, c3, q1]
    second = make_chunks(10, 2, 3, 4, tail=[8])  # [sys, c2, c3, c4, q2]
    view = DictView.holding(first)
    plan = plan_request(
        second, view, num_computed_tokens=0, num_tokens=17, keys=RequestKeys(lineage=P),
    )
    assert [(i.mode, i.begin, i.end) for i in plan.loads] == [
        (EXACT, 0, 4),
        (SURVIVOR, 4, 8),
        (SURVIVOR, 8, 12),
    ]
    assert plan.decision(1).source_antecedent == (first[0].cid, first[1].cid)
    assert plan.decision(3).mode == MISS
    assert plan.first_approximate_token == 4
    assert view.num_calls == 3
    # With survivors off, the run ends after sys; so it does for an exact request (no policy).
    plan = plan_request(
        second, view, num_computed_tokens=0, num_tokens=17, modes={EXACT},
        keys=RequestKeys(lineage=P),
    )
    assert plan.num_external_tokens == 4
    plan = plan_request(second, view, num_computed_tokens=0, num_tokens=17)
    assert plan.num_external_tokens == 4 and plan.first_approximate_token is None


def test_survivor_needs_order_kept_and_a_live_entry():
    first = make_chunks(10, 1, 2)
    view = DictView.holding(first)
    swapped = make_chunks(10, 2, 1)  # c1's stored antecedent (sys) does not reduce to (sys, c2)
    plan = plan_request(
        swapped, view, num_computed_tokens=0, num_tokens=13, keys=RequestKeys(lineage=P),
    )
    assert [i.mode for i in plan.loads] == [EXACT, SURVIVOR]
    assert plan.decision(2).mode == MISS
    # The index lists an antecedent whose entry is gone: not served.
    view2 = DictView()
    view2.add_conditioned(first[0])
    view2.antecedents[first[2].cid] = [first[2].antecedent]
    plan = plan_request(
        make_chunks(10, 2), view2, num_computed_tokens=0, num_tokens=9, keys=RequestKeys(lineage=P),
    )
    assert [i.mode for i in plan.loads] == [EXACT]


def test_patched_and_blind_need_their_entries_and_modes():
    chunks = make_chunks(10, 5, tail=[1])
    view = DictView()
    view.add_conditioned(chunks[0])
    canon = canonical_key(chunks[1].cid, "")
    view.add(canon)
    plan = plan_request(
        chunks, view, num_computed_tokens=0, num_tokens=9,
        keys=RequestKeys(patch_rank=8, lineage=P),
    )
    assert plan.decision(1).mode == MISS  # blind is off by default, no patch yet
    plan = plan_request(
        chunks, view, num_computed_tokens=0, num_tokens=9, modes={EXACT, BLIND},
        keys=RequestKeys(lineage=P),
    )
    assert plan.decision(1).mode == BLIND and plan.loads[1].key == canon
    patch = patch_key(chunks[1].cid, chunks[1].antecedent_hash, 8)
    view.add(patch)
    plan = plan_request(
        chunks, view, num_computed_tokens=0, num_tokens=9,
        keys=RequestKeys(patch_rank=8, lineage=P),
    )
    assert plan.decision(1).mode == PATCHED
    assert (plan.loads[1].key, plan.loads[1].patch_key) == (canon, patch)
    # Rank 0 means patches are not formed: the mode is off. No policy: no approximate mode.
    plan = plan_request(
        chunks, view, num_computed_tokens=0, num_tokens=9,
        keys=RequestKeys(patch_rank=0, lineage=P),
    )
    assert plan.decision(1).mode == MISS
    plan = plan_request(
        chunks, view, num_computed_tokens=0, num_tokens=9, keys=RequestKeys(patch_rank=8),
    )
    assert plan.decision(1).mode == MISS


def test_canonicals_are_looked_up_in_their_context():
    """A canonical stored after another context (another anchor, or none) is not this one's."""
    chunks = make_chunks(10, 5, tail=[1])
    view = DictView()
    view.add_conditioned(chunks[0])
    anchor_ctx = antecedent_hash(["c" * 32])
    view.add(canonical_key(chunks[1].cid, anchor_ctx))
    view.add(patch_key(chunks[1].cid, chunks[1].antecedent_hash, 8))
    plan = plan_request(
        chunks, view, num_computed_tokens=0, num_tokens=9,
        keys=RequestKeys(patch_rank=8, lineage=P),
    )
    assert plan.decision(1).mode == MISS and not plan.decision(1).has_canonical
    plan = plan_request(
        chunks, view, num_computed_tokens=0, num_tokens=9,
        keys=RequestKeys(patch_rank=8, lineage=P, canonical_context=anchor_ctx),
    )
    assert plan.decision(1).mode == PATCHED and plan.decision(1).has_canonical


def test_inherited_entries_serve_their_own_policy_only():
    """A conditioned entry computed over approximate KV under policy P: P gets it (approximately),
    an exact request and a request under Q never do, and each sees the save-skip flag it needs."""
    chunks = make_chunks(10, 1, 2, tail=[3])
    view = DictView()
    view.add_conditioned(chunks[0])
    for c in chunks[1:3]:
        view.add_conditioned(c, lineage=P)
    plan = plan_request(
        chunks, view, num_computed_tokens=0, num_tokens=13, keys=RequestKeys(lineage=P),
    )
    assert [(i.mode, i.begin) for i in plan.loads] == [(EXACT, 0), (INHERITED, 4), (INHERITED, 8)]
    assert plan.first_approximate_token == 4
    assert plan.decision(1).has_inherited_entry and not plan.decision(1).has_exact_entry
    for lineage in ("", Q):
        plan = plan_request(
            chunks, view, num_computed_tokens=0, num_tokens=13, keys=RequestKeys(lineage=lineage),
        )
        assert [i.mode for i in plan.loads] == [EXACT]
        assert not plan.decision(1).has_inherited_entry
    # An exact entry of the same antecedent wins over the inherited one.
    view.add_conditioned(chunks[1])
    plan = plan_request(
        chunks, view, num_computed_tokens=0, num_tokens=13, keys=RequestKeys(lineage=P),
    )
    assert [i.mode for i in plan.loads] == [EXACT, EXACT, INHERITED]


def test_survivors_of_approximate_entries_stay_in_their_policy():
    first = make_chunks(10, 1, 2, tail=[7])
    second = make_chunks(10, 2, tail=[8])
    view = DictView()
    view.add_conditioned(first[0])
    view.add_conditioned(first[2], lineage=P)
    plan = plan_request(
        second, view, num_computed_tokens=0, num_tokens=9, keys=RequestKeys(lineage=P),
    )
    assert [i.mode for i in plan.loads] == [EXACT, SURVIVOR]
    assert plan.loads[1].key.endswith(":l" + P)
    plan = plan_request(
        second, view, num_computed_tokens=0, num_tokens=9, keys=RequestKeys(lineage=Q),
    )
    assert [i.mode for i in plan.loads] == [EXACT]


def test_exact_entry_flag_survives_modes_off():
    chunks = make_chunks(1, 2)
    view = DictView.holding(chunks)
    plan = plan_request(
        chunks, view, num_computed_tokens=0, num_tokens=8, modes=set(),
        keys=RequestKeys(lineage=P),
    )
    assert plan.num_external_tokens == 0
    assert all(d.has_exact_entry and d.mode == MISS for d in plan.decisions)


def test_nothing_left_to_serve():
    chunks = make_chunks(1, 2)
    view = DictView()
    plan = plan_request(chunks, view, num_computed_tokens=7, num_tokens=8)
    assert plan.num_external_tokens == 0 and view.num_calls == 0
    assert plan_request([], view, num_computed_tokens=0, num_tokens=1).num_external_tokens == 0


def test_preempted_request_with_outputs_may_serve_whole_prompt():
    chunks = make_chunks(1, 2)
    view = DictView.holding(chunks)
    plan = plan_request(chunks, view, num_computed_tokens=0, num_tokens=11)
    assert plan.num_external_tokens == 8
