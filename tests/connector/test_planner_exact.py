"""The planner's exact path (``planner._decide_exact``, every request naming no policy) decides
as the general path does, chunk for chunk; and ``metadata.slots_for`` against its definition."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from orbitkv.connector.chunking import KeyContext, chunk_prompt
from orbitkv.connector.metadata import slots_for
from orbitkv.connector.scheduler import planner
from orbitkv.connector.scheduler.planner import ALL_MODES, EXACT_ONLY, plan_request
from orbitkv.store.keys import RequestKeys, canonical_key
from planner_testlib import DictView


def _every_mode(chunk):
    """A mode filter narrowing nothing: the general path, for the same modes."""
    return frozenset(ALL_MODES)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_segments=st.integers(1, 12),
    anchor=st.sampled_from([(), (7, 7)]),
    context=st.sampled_from(["", "c" * 32]),
)
def test_the_exact_path_decides_as_the_general_one(seed, num_segments, anchor, context):
    rng = random.Random(seed)
    tokens = [t for _ in range(num_segments) for t in [rng.randrange(5)] * rng.randrange(1, 9)]
    if anchor and rng.random() < 0.7:
        tokens = list(anchor) + tokens
    chunks = chunk_prompt(tokens, [], 4, KeyContext("fp", "mha:bfloat16", ""),
                          anchor_ids=anchor, text_chunking="fixed")
    keys = RequestKeys(canonical_context=context)
    view = DictView()
    for c in chunks:
        if rng.random() < 0.5:
            view.add_conditioned(c, tier=rng.choice(["memory", "disk"]))
        if rng.random() < 0.5:
            view.add(canonical_key(c.cid, context), tier="disk")
    args = (chunks, view, EXACT_ONLY, keys, len(tokens) - 1)
    assert planner._decide(*args, None) == planner._decide(*args, _every_mode)
    plans = [
        plan_request(chunks, view, num_computed_tokens=start, num_tokens=len(tokens),
                     modes=EXACT_ONLY, min_hole_tokens=4, mode_filter=mode_filter, keys=keys)
        for start in (0, len(tokens) // 2)
        for mode_filter in (None, _every_mode)
    ]
    assert plans[0] == plans[1] and plans[2] == plans[3]


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.integers(1, 20),
    num_blocks=st.integers(1, 8),
    data=st.data(),
)
def test_slots_for_is_one_slot_per_token(block_size, num_blocks, data):
    block_ids = data.draw(st.lists(st.integers(0, 500), min_size=num_blocks, max_size=num_blocks))
    begin = data.draw(st.integers(0, block_size * num_blocks))
    end = data.draw(st.integers(begin, block_size * num_blocks))
    slots = slots_for(block_ids, block_size, begin, end)
    assert slots.typecode == "q"  # the worker takes its bytes as an int64 tensor as they are
    assert list(slots) == [
        block_ids[p // block_size] * block_size + p % block_size for p in range(begin, end)
    ]
