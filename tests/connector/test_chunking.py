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
    # vLLM's identifiers are the keys only where client ids are trusted (test_mm_identity.py).
    assert mm_spans_from_features(feats, is_client_trusted=True) == [
        MMSpan(1, 3, "a"), MMSpan(9, 2, "b")
    ]
    assert mm_spans_from_features(None) == []


def test_cids_are_position_free_and_antecedents_ordered():
    sys_, c1, c2, c3 = ([i] * 4 for i in (1, 2, 3, 4))
    a = chunk_prompt(sys_ + c1 + c2 + c3 + [9], [], 4, CTX, text_chunking="fixed")
    b = chunk_prompt(sys_ + c2 + c3 + [9, 9], [], 4, CTX, text_chunking="fixed")
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
    base = chunk_prompt(toks, mm1, 4, CTX, text_chunking="fixed")[0].cid
    assert chunk_prompt(toks, mm2, 4, CTX, text_chunking="fixed")[0].cid != base
    assert chunk_prompt(toks, mm1, 4, KeyContext("fp", "mha:bfloat16", "t2"), text_chunking="fixed")[0].cid != base
    assert chunk_prompt(toks, mm1, 4, KeyContext("fp", "mha:float16", ""), text_chunking="fixed")[0].cid != base
    assert chunk_prompt(toks, mm1, 4, CTX, text_chunking="fixed")[0].is_mm


def test_anchor_split_only_when_prompt_starts_with_it():
    with_anchor = chunk_prompt([1, 5, 6, 7], [], 4, CTX, anchor_ids=[1], text_chunking="fixed")
    assert [c.length for c in with_anchor] == [1, 3]
    assert with_anchor[0].is_anchor and with_anchor[1].is_canonical_slot
    # Without the anchor, the first chunk's KV is KV(B|nothing): another context than the
    # canonical's, so it is no canonical slot (it would overwrite the canonical's key).
    without = chunk_prompt([2, 5, 6, 7], [], 4, CTX, anchor_ids=[1], text_chunking="fixed")
    assert [c.length for c in without] == [4] and not without[0].is_canonical_slot
    # A model without an anchor: its canonical context is the empty one, chunk 0's.
    no_anchor = chunk_prompt([2, 5, 6, 7], [], 4, CTX, text_chunking="fixed")
    assert no_anchor[0].is_canonical_slot


def test_the_canonical_slot_follows_the_anchor_context_canonicals_are_keyed_in():
    """The save path names a canonical in the request's context (``store.keys.anchor_context``),
    which is the canonical slot's own antecedent hash: per tenant, salt and adapter, with an anchor
    and without one (the empty context)."""
    from orbitkv.store.keys import anchor_context

    for ctx in (CTX, KeyContext("fp", "mha:bfloat16", "t", "salt", "lora")):
        chunks = chunk_prompt([1, 2, 5, 6, 7], [], 4, ctx, anchor_ids=[1, 2], text_chunking="fixed")
        (slot,) = [c for c in chunks if c.is_canonical_slot]
        assert slot.antecedent_hash == anchor_context(
            ctx.model_fingerprint, ctx.layout, [1, 2], tenant=ctx.tenant,
            cache_salt=ctx.cache_salt, lora=ctx.lora,
        )
    no_anchor = chunk_prompt([2, 5, 6, 7], [], 4, CTX, text_chunking="fixed")
    assert no_anchor[0].antecedent_hash == anchor_context("fp", "mha:bfloat16", ())


def test_chunk_at():
    chunks = chunk_prompt(list(range(10)), [], 4, CTX, text_chunking="fixed")
    assert [chunk_at(chunks, p) for p in (0, 3, 4, 9, 10, 50)] == [0, 0, 1, 2, 3, 3]


# -- content-defined text chunks ---------------------------------------------------------------

import random  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _text(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def _token_runs(chunks, ids) -> list[tuple[int, ...]]:
    return [tuple(ids[c.start : c.end]) for c in chunks]


def test_same_text_gives_the_same_chunks_whatever_surrounds_it():
    body = _text(1, 600)
    a = _text(2, 37) + body + _text(3, 50)
    b = _text(4, 113) + body + _text(5, 9)
    runs_a, runs_b = (set(_token_runs(chunk_prompt(p, [], 64, CTX), p)) for p in (a, b))
    shared = runs_a & runs_b
    # Everything but the first chunk reaching into the body and the last one leaving it matches.
    assert sum(len(r) for r in shared) >= len(body) - 2 * 64
    # Fixed runs from each stretch start share nothing once the offsets differ.
    fixed_a, fixed_b = (
        set(_token_runs(chunk_prompt(p, [], 64, CTX, text_chunking="fixed"), p)) for p in (a, b)
    )
    assert not fixed_a & fixed_b


def test_text_after_an_item_matches_when_its_tail_changes():
    obs = _text(6, 300)
    image = MMSpan(20, 16, "img")
    head = _text(7, 20) + [0] * 16
    before = head + obs + _text(8, 40)  # the observation followed by a question
    after = head + obs + [0] * 16  # ... and later by the next image
    chunks_before = chunk_prompt(before, [image], 64, CTX)
    chunks_after = chunk_prompt(after, [image, MMSpan(len(head) + len(obs), 16, "img2")], 64, CTX)
    cids_after = {c.cid for c in chunks_after}
    matched = [c for c in chunks_before if c.cid in cids_after and not c.is_mm and c.start >= 36]
    assert sum(c.length for c in matched) >= len(obs) - 64


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 900),
    chunk_size=st.sampled_from([4, 16, 64, 256]),
    items=st.lists(st.tuples(st.integers(0, 900), st.integers(1, 40)), max_size=4),
    seed=st.integers(0, 10_000),
)
def test_content_chunks_tile_the_prompt_within_bounds(n, chunk_size, items, seed):
    ids = _text(seed, n)
    spans, pos = [], 0
    for offset, length in sorted(items):
        if offset >= pos and offset + length <= n:
            spans.append(MMSpan(offset, length, f"i{offset}"))
            pos = offset + length
    chunks = chunk_prompt(ids, spans, chunk_size, CTX)
    assert [c.start for c in chunks] == [0] + [c.end for c in chunks[:-1]] if chunks else n == 0
    assert (chunks[-1].end if chunks else 0) == n
    for c in chunks:
        if not c.is_mm:
            assert 1 <= c.length <= chunk_size
    assert [c.mm_identifier for c in chunks if c.is_mm] == [s.identifier for s in spans]


def test_lines_are_chunks_whatever_follows_them():
    newline = 10
    obs = _text(9, 20) + [newline]
    tool = _text(10, 15) + [newline]
    image = [0] * 16
    step_a = _text(11, 30) + [newline] + image + obs + tool + image + _text(12, 6)
    step_b = _text(11, 30) + [newline] + image + obs + image + _text(13, 6)
    spans_a = [MMSpan(31, 16, "img1"), MMSpan(31 + 16 + len(obs) + len(tool), 16, "img2")]
    spans_b = [MMSpan(31, 16, "img1"), MMSpan(31 + 16 + len(obs), 16, "img3")]
    lines = frozenset({newline})
    a = chunk_prompt(step_a, spans_a, 256, CTX, line_end_ids=lines)
    b = chunk_prompt(step_b, spans_b, 256, CTX, line_end_ids=lines)
    obs_a = next(c for c in a if c.start == 47)
    obs_b = next(c for c in b if c.start == 47)
    assert obs_a.length == obs_b.length == len(obs) and obs_a.cid == obs_b.cid
    # Without line ends the observation and the tool output share a chunk in step a.
    plain = chunk_prompt(step_a, spans_a, 256, CTX)
    assert next(c for c in plain if c.start == 47).length > len(obs)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3_000), max_size=200),
    line_end_ids=st.frozensets(st.integers(0, 3_500), min_size=1, max_size=40),
)
def test_a_cut_follows_every_line_end_id_whatever_the_tokenizers_ids(tokens, line_end_ids):
    spans = split_spans(len(tokens), [], 10_000, token_ids=tokens, line_end_ids=line_end_ids)
    ends = {s.end for s in spans[:-1]}
    line_ends = {i + 1 for i, t in enumerate(tokens[:-1]) if t in line_end_ids}
    # Content-defined cuts come on top: every line end cuts, and the rest are content cuts.
    assert line_ends <= ends
    content = split_spans(len(tokens), [], 10_000, token_ids=tokens)
    assert ends == line_ends | {s.end for s in content[:-1]}
