"""A prompt's chunk keys in one native call (``connector/chunk_keys.py``, ``csrc/keys.cpp``):
the same strings as ``store/keys.py``'s definition (``prompt_cids``, ``antecedent_hashes``,
``conditioned_key``) through the extension module, through ``ctypes``, and without the library."""

from __future__ import annotations

from array import array
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from orbitkv.connector.chunk_keys import chunk_keys, chunk_keys_ref
from orbitkv.kernels import native
from orbitkv.store.keys import EntryKey, antecedent_hash, chunk_cid

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C++ compiler on PATH")


def _using(lib):
    """``native.library()`` answers ``lib`` (None: as without a compiler) inside the block."""
    return mock.patch.dict(native._state, {"lib": lib})


@st.composite
def prompts(draw):
    """Tokens (any int64), and runs tiling a part of them: text, or an item named by any text."""
    tokens = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=300))
    cuts = sorted(draw(st.sets(st.integers(1, len(tokens) - 1), max_size=40))) if len(
        tokens) > 1 else []
    bounds = [0, *cuts, len(tokens)]
    names = st.one_of(st.none(), st.text(min_size=0, max_size=40))
    runs = [(s, e, draw(names)) for s, e in zip(bounds, bounds[1:], strict=False)
            if draw(st.booleans()) or s == 0]
    return tokens, runs


@settings(max_examples=60, deadline=None)
@given(prompt=prompts(), salt=st.text(max_size=8), tenant=st.text(max_size=8))
def test_the_keys_are_the_definition_s_through_every_binding(bindings, prompt, salt, tenant):
    tokens, runs = prompt
    want = chunk_keys_ref("fp", "cpu_vec", tenant, tokens, runs, cache_salt=salt, lora="a")
    for lib in [*bindings, None]:
        for given_tokens in (array("q", tokens), tokens):
            with _using(lib):
                got = chunk_keys("fp", "cpu_vec", tenant, given_tokens, runs, cache_salt=salt,
                                 lora="a")
            assert got == want
    # And the definition is what it says: one chunk's cid, a prefix's antecedent hash, the exact
    # entry of each chunk behind its prefix.
    cids, antecedents, exact_keys = want
    assert len(antecedents) == len(cids) + 1 and antecedents[0] == antecedent_hash(())
    assert [EntryKey.parse(k) for k in exact_keys] == [
        EntryKey(c, "conditioned", antecedents[i]) for i, c in enumerate(cids)
    ]
    start, end, item = runs[-1]
    whole = [(0, end - start, item)] if item is not None else None
    assert cids[-1] == chunk_cid("fp", "cpu_vec", tenant, tokens[start:end], whole,
                                 cache_salt=salt, lora="a")
    assert antecedents[-1] == antecedent_hash(cids)


@pytest.mark.parametrize("bad", [(0, 11, None), (3, 3, None), (-1, 2, None), (4, 2, "img")])
def test_a_run_outside_the_prompt_is_refused_by_every_binding(bindings, bad):
    tokens = array("q", range(10))
    runs = [(0, 2, None), bad]
    with pytest.raises(ValueError, match="bad chunk"):
        chunk_keys_ref("fp", "cpu_vec", "", tokens, runs)
    for lib in [*bindings, None]:
        with _using(lib), pytest.raises(ValueError, match=r"bad chunk \[.*\) for 10 tokens"):
            chunk_keys("fp", "cpu_vec", "", tokens, runs)


def test_keys_differ_with_what_they_hash(bindings, monkeypatch):
    """A mutation check against a keyer that ignores a field: every input changes the keys."""
    monkeypatch.setitem(native._state, "lib", bindings[0])
    tokens = array("q", range(40))
    runs = [(0, 10, None), (10, 30, "item-a"), (30, 40, None)]
    base = chunk_keys("fp", "cpu_vec", "", tokens, runs)
    changed = [
        chunk_keys("fp2", "cpu_vec", "", tokens, runs),
        chunk_keys("fp", "cpu_amx", "", tokens, runs),
        chunk_keys("fp", "cpu_vec", "t", tokens, runs),
        chunk_keys("fp", "cpu_vec", "", tokens, runs, cache_salt="s"),
        chunk_keys("fp", "cpu_vec", "", tokens, runs, lora="l"),
        chunk_keys("fp", "cpu_vec", "", tokens, [runs[0], (10, 30, "item-b"), runs[2]]),
        chunk_keys("fp", "cpu_vec", "", array("q", [*range(39), 99]), runs),
    ]
    for cids, antecedents, exact_keys in changed:
        assert cids != base[0] and antecedents[-1] != base[1][-1]
        assert antecedents[0] == base[1][0]  # the empty antecedent names no chunk
        assert exact_keys[-1] != base[2][-1]
    # An item's chunk is named by the item, not its placeholder tokens.
    assert chunk_keys("fp", "cpu_vec", "", array("q", [7] * 40), runs)[0][1] == base[0][1]


@pytest.mark.parametrize(
    ("runs", "error"),
    [
        (5, "runs must be a sequence"),
        ([(0, 2)], r"each must be \(start, end, item or None\)"),
        ([(0, "2", None)], "integer"),
        ([(0, 2, 7)], ""),  # a name that is not text
    ],
)
def test_the_module_refuses_runs_it_cannot_read_with_a_type_error(bindings, runs, error):
    """The module's parse of (start, end, name) tuples, shared with ``chunk_prompt``'s items."""
    if native.python_include() is None:
        pytest.skip("no Python headers: no extension module")
    with pytest.raises(TypeError, match=error):
        bindings[0].chunk_keys(array("q", [1, 2, 3]), runs, b"p", b"v", b"h")


def test_the_module_refuses_items_it_cannot_read_with_a_type_error(bindings):
    if native.python_include() is None:
        pytest.skip("no Python headers: no extension module")
    lib = bindings[0]
    # boundaries, anchor_len, chunk_size, is_content, line_end_table, window, min_len, mask, prefix,
    # version, key_head
    rest = ([], 0, 16, 1, b"", 0, 0, 0, b"p", b"v", b"h")
    with pytest.raises(TypeError, match=r"items: each must be \(offset, length, name\)"):
        lib.chunk_prompt(array("q", [1, 2, 3]), [(0, 1)], *rest)
    with pytest.raises(TypeError):  # None names no item
        lib.chunk_prompt(array("q", [1, 2, 3]), [(0, 1, None)], *rest)
