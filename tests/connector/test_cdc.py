"""Content-defined cut points (``connector/cdc.py``) against their definition, computed the slow
way in Python integers: the vector forms must keep every cut, so every stored text chunk's cid."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from orbitkv.connector import cdc

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _window_hash(tokens: list[int], i: int, window: int) -> int:
    total = 0
    for j in range(min(window, i + 1)):
        g = _mix((tokens[i - j] + 0x9E3779B97F4A7C15) & _MASK)
        total = (total + g * pow(0x100000001B3, j, 1 << 64)) & _MASK
    return _mix(total)


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=300),
    window=st.integers(1, 24),
)
def test_window_hashes_are_the_windows_polynomial(tokens, window):
    hashes = cdc.window_hashes(tokens, window=window)
    assert hashes.dtype == np.uint64 and hashes.shape == (len(tokens),)
    assert [int(h) for h in hashes] == [
        _window_hash(tokens, i, window) for i in range(len(tokens))
    ]


def test_a_window_of_no_tokens_is_refused():
    import pytest

    with pytest.raises(ValueError, match="window must be at least 1"):
        cdc.window_hashes([1, 2, 3], window=0)


def test_window_hashes_of_long_prompts_grow_their_power_tables():
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 50_000, 5_000).tolist()
    hashes = cdc.window_hashes(tokens)
    for i in (0, 15, 16, 1_023, 1_024, 2_047, 4_999):
        assert int(hashes[i]) == _window_hash(tokens, i, cdc.WINDOW)


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(0, 400),
    seed=st.integers(0, 1_000),
    min_len=st.integers(1, 16),
    extra=st.integers(0, 40),
    avg_gap=st.sampled_from([1, 2, 4, 8, 16]),
    margins=st.tuples(st.integers(0, 30), st.integers(0, 30)),
)
def test_content_cuts_are_the_first_candidates_past_min_len(n, seed, min_len, extra, avg_gap, margins):
    tokens = np.random.default_rng(seed).integers(0, 1_000, n)
    hashes = cdc.window_hashes(tokens)
    start, end = min(margins[0], n), max(min(margins[0], n), n - margins[1])
    max_len = min_len + extra
    bits = (1 << (avg_gap.bit_length() - 1)) - 1
    expected, pos = [], start
    while pos < end:
        limit = min(pos + max_len, end)
        ends = [e for e in range(pos + min_len, limit + 1) if int(hashes[e - 1]) & bits == 0]
        pos = ends[0] if ends else limit
        expected.append(pos)
    candidates = cdc.candidate_ends(hashes, avg_gap)
    assert cdc.content_cuts(candidates, start, end, min_len=min_len, max_len=max_len) == expected


def _stretches(n: int, gaps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Text stretches of an ``n``-token prompt, items of the given (text, item) lengths between."""
    out, pos = [], 0
    for text, item in gaps:
        end = min(pos + text, n)
        if end > pos:
            out.append((pos, end))
        pos = min(end + item, n)
    if pos < n:
        out.append((pos, n))
    return out


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 600),
    seed=st.integers(0, 1_000),
    chunk_size=st.sampled_from([1, 2, 7, 16, 64, 256]),
    vocab=st.sampled_from([3, 50, 50_000, 2**40]),
    gaps=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 80)), max_size=4),
    line_ends=st.sets(st.integers(-2, 60), max_size=5),
)
def test_text_cuts_are_the_numpy_definitions(n, seed, chunk_size, vocab, gaps, line_ends):
    """The native pass (or, without a compiler, the numpy one) finds every cut the numpy
    definition finds, and no other: the same chunks, so the same cids."""
    tokens = np.random.default_rng(seed).integers(-1 if vocab == 3 else 0, vocab, n)
    stretches = _stretches(n, gaps)
    table = None
    if line_ends:
        table = np.zeros(max(max(line_ends), -1) + 3, dtype=bool)
        table[[t + 1 for t in line_ends if t >= 0]] = True
    kwargs = dict(min_len=max(1, chunk_size // 4), max_len=chunk_size, line_end_table=table)
    got = cdc.text_cuts(tokens, stretches, **kwargs)
    assert got == cdc.text_cuts_ref(tokens, stretches, **kwargs)
    assert got == sorted(set(got))


def test_text_cuts_run_natively_where_a_compiler_is():
    import shutil

    import pytest
    from orbitkv.kernels import native

    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler: text_cuts takes the numpy path")
    assert native.library() is not None
    tokens = np.random.default_rng(1).integers(0, 50_000, 3_000)
    table = np.zeros(202, dtype=bool)
    table[199] = True  # token 198 ends a line
    tokens[::37] = 198
    stretches = [(0, 1_000), (1_200, 3_000)]
    got = cdc.text_cuts(tokens, stretches, min_len=64, max_len=256, line_end_table=table)
    assert got == cdc.text_cuts_ref(tokens, stretches, min_len=64, max_len=256,
                                    line_end_table=table)
    assert 1_000 in got and 3_000 in got and 38 in got  # stretch ends, a line end


def test_line_ends_at_the_edges_of_the_id_range_are_numpys():
    """Ids below the table, past it, and at int64's limits land where numpy's clipped take puts
    them (``id + 1`` wraps at the top), whatever the table's end entries hold."""
    tokens = np.array([2**63 - 1, -5, -1, 0, 3, 2**62, 2**63 - 2, 7, 1, -(2**63)], dtype=np.int64)
    for first, last in ((True, False), (False, True), (True, True)):
        table = np.zeros(6, dtype=bool)
        table[[0, 5]] = first, last
        table[2] = True  # id 1
        got = cdc.text_cuts(tokens, [], min_len=2, max_len=4, line_end_table=table)
        assert got == cdc.text_cuts_ref(tokens, [], min_len=2, max_len=4, line_end_table=table)


def test_text_stretches_outside_the_prompt_are_refused_by_both_paths():
    import pytest

    tokens = np.arange(10, dtype=np.int64)
    for fn in (cdc.text_cuts, cdc.text_cuts_ref):
        with pytest.raises(ValueError, match="do not fit a 10-token prompt"):
            fn(tokens, [(5, 11)], min_len=2, max_len=4)


def test_chunk_lengths_out_of_order_are_refused_by_every_path():
    import pytest

    tokens = np.arange(10, dtype=np.int64)
    for min_len, max_len in ((0, 4), (5, 4)):
        for fn in (cdc.text_cuts, cdc.text_cuts_ref):
            with pytest.raises(ValueError, match="need 1 <= min_len <= max_len"):
                fn(tokens, [(0, 10)], min_len=min_len, max_len=max_len)
        with pytest.raises(ValueError, match="need 1 <= min_len <= max_len"):
            cdc.content_cuts([], 0, 10, min_len=min_len, max_len=max_len)
