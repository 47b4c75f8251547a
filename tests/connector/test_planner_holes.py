"""Planner: holes, cached chunks served behind fresh ones (``planner.find_holes``)."""

from __future__ import annotations

from orbitkv.connector.chunking import chunk_prompt
from orbitkv.connector.scheduler.planner import EXACT, plan_request
from planner_testlib import CS, CTX, DictView, make_chunks, mode_summary


def test_holes_behind_fresh_chunks():
    chunks = make_chunks(1, 2, 3, 4, 5, 6, tail=[9])  # 24 tokens of chunks + 1
    view = DictView()
    for i in (0, 2, 3, 5):
        view.add_conditioned(chunks[i])
    plan = plan_request(chunks, view, num_computed_tokens=0, num_tokens=25, min_hole_tokens=1)
    assert plan.num_external_tokens == 4  # the prefix run: chunk 0
    assert [(h.start, h.end, [i.chunk_index for i in h.loads]) for h in plan.holes] == [
        (8, 16, [2, 3]),
        (20, 24, [5]),
    ]
    assert all(i.begin == chunks[i.chunk_index].start for h in plan.holes for i in h.loads)
    assert mode_summary(plan) == {EXACT: 16}
    # Holes shorter than the minimum are computed instead; 0 plans none at all.
    plan = plan_request(chunks, view, num_computed_tokens=0, num_tokens=25, min_hole_tokens=5)
    assert [(h.start, h.end) for h in plan.holes] == [(8, 16)]
    plan = plan_request(chunks, view, num_computed_tokens=0, num_tokens=25)
    assert plan.holes == ()


def test_hole_never_reaches_the_last_prompt_token():
    chunks = make_chunks(1, 2, 3)  # the prompt ends with chunk 2's last token
    view = DictView()
    for i in (0, 2):
        view.add_conditioned(chunks[i])
    plan = plan_request(chunks, view, num_computed_tokens=0, num_tokens=12, min_hole_tokens=1)
    assert plan.holes == ()  # chunk 2 ends at 12 > 11: vLLM must compute the last token
    plan = plan_request(chunks, view, num_computed_tokens=0, num_tokens=13, min_hole_tokens=1)
    assert [(h.start, h.end) for h in plan.holes] == [(8, 12)]  # one output token: 12 <= 12


def test_holes_cover_whole_multimodal_spans():
    from orbitkv.connector.chunking import MMSpan

    ids = [5] * 6 + [0] * 10 + [6] * 4 + [0] * 10 + [7] * 3
    spans = [MMSpan(6, 10, "img-a"), MMSpan(20, 10, "img-b")]
    chunks = chunk_prompt(ids, spans, CS, CTX, text_chunking="fixed")
    image_b = next(c for c in chunks if c.mm_identifier == "img-b")
    view = DictView()
    view.add_conditioned(image_b)
    plan = plan_request(chunks, view, num_computed_tokens=0, num_tokens=len(ids), min_hole_tokens=1)
    assert [(h.start, h.end) for h in plan.holes] == [(image_b.start, image_b.end)]
    assert (image_b.start, image_b.end) == (20, 30)
