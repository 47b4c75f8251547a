"""Chunking: spans, keys, antecedents. Pure, no vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from orbitkv.connector.chunking import (
    KeyContext,
    MMSpan,
    chunk_at,
    chunk_prompt,
    mm_spans_from_features,
    split_spans,
)

CTX = KeyContext("fp", "mha:bfloat16", "")


def _extents(spans):
    return [(s.start, s.length) for s in spans]


def test_text_only_splits_in_chunk_size_runs():
    assert _extents(split_spans(10, [], 4)) == [(0, 4), (4, 4), (8, 2)]
    assert _extents(split_spans(8, [], 4)) == [(0, 4), (4, 4)]
    assert split_spans(0, [], 4) == []


def test_each_item_is_one_chunk_and_text_restarts_after_it():
    mm = [MMSpan(5, 3, "imgA"), MMSpan(8, 4, "imgB")]
    spans = split_spans(17, mm, 4)
    assert _extents(spans) == [(0, 4), (4, 1), (5, 3), (8, 4), (12, 4), (16, 1)]
    assert [s.mm.identifier if s.mm else None for s in spans] == [
        None,
        None,
        "imgA",
        "imgB",
        None,
        None,
    ]


def test_anchor_and_boundaries():
    spans = split_spans(12, [], 8, anchor_len=1, boundaries=[5, 99])
    assert _extents(spans) == [(0, 1), (1, 4), (5, 7)]
    assert spans[0].is_anchor


def test_overlapping_items_are_rejected():
    with pytest.raises(ValueError):
        split_spans(10, [MMSpan(2, 4, "a"), MMSpan(4, 2, "b")], 4)
    with pytest.raises(ValueError):
        split_spans(10, [MMSpan(8, 4, "a")], 4)


def test_mm_features_are_read_and_sorted():
    feats = [
        SimpleNamespace(
            identifier="b", modality="image", mm_position=SimpleNamespace(offset=9, length=2)
        ),
        SimpleNamespace(
            identifier="a", modality="image", mm_position=SimpleNamespace(offset=1, length=3)
        ),
    ]
    assert mm_spans_from_features(feats) == [MMSpan(1, 3, "a"), MMSpan(9, 2, "b")]
    assert mm_spans_from_features(None) == []


def test_cids_are_position_free_and_antecedents_ordered():
    sys_, c1, c2, c3 = ([i] * 4 for i in (1, 2, 3, 4))
    a = chunk_prompt(sys_ + c1 + c2 + c3 + [9], [], 4, CTX)
    b = chunk_prompt(sys_ + c2 + c3 + [9, 9], [], 4, CTX)
    assert a[2].cid == b[1].cid and a[3].cid == b[2].cid
    assert a[2].start == 8 and b[1].start == 4
    assert b[2].antecedent == (b[0].cid, b[1].cid)
    assert a[3].antecedent == (a[0].cid, a[1].cid, a[2].cid)
    assert a[3].antecedent_hash != b[2].antecedent_hash
    assert a[0].antecedent == () and a[0].is_canonical_slot and not a[1].is_canonical_slot


def test_cid_depends_on_tenant_layout_and_item_hash():
    toks = [5, 5, 5, 5, 7, 7]
    mm1 = [MMSpan(0, 4, "img1")]
    mm2 = [MMSpan(0, 4, "img2")]
    base = chunk_prompt(toks, mm1, 4, CTX)[0].cid
    assert chunk_prompt(toks, mm2, 4, CTX)[0].cid != base
    assert chunk_prompt(toks, mm1, 4, KeyContext("fp", "mha:bfloat16", "t2"))[0].cid != base
    assert chunk_prompt(toks, mm1, 4, KeyContext("fp", "mha:float16", ""))[0].cid != base
    assert chunk_prompt(toks, mm1, 4, CTX)[0].is_mm


def test_anchor_split_only_when_prompt_starts_with_it():
    with_anchor = chunk_prompt([1, 5, 6, 7], [], 4, CTX, anchor_ids=[1])
    assert [c.length for c in with_anchor] == [1, 3]
    assert with_anchor[0].is_anchor and with_anchor[1].is_canonical_slot
    without = chunk_prompt([2, 5, 6, 7], [], 4, CTX, anchor_ids=[1])
    assert [c.length for c in without] == [4] and without[0].is_canonical_slot


def test_chunk_at():
    chunks = chunk_prompt(list(range(10)), [], 4, CTX)
    assert [chunk_at(chunks, p) for p in (0, 3, 4, 9, 10, 50)] == [0, 0, 1, 2, 3, 3]
