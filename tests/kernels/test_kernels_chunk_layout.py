"""A prompt laid out and keyed in one native call (``chunk_keys.layout_keys``, ``csrc/layout.cpp``):
``chunking.chunk_prompt`` gives the chunks of its definition (``split_spans`` with numpy's cuts,
then ``key_spans`` with ``store/keys.py``'s keys) through the extension module, through
``ctypes`` (which has no layout call: the Python split, native keys) and without the library, and
refuses the same prompts."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from orbitkv.connector.chunking import KeyContext, MMSpan, chunk_prompt, split_spans
from orbitkv.kernels import native

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C++ compiler on PATH")

CTX = KeyContext("fp", "cpu_vec", "tenant", "salt", "lora")


def _chunked(lib, *args, **kwargs):
    """``chunk_prompt`` with ``native.library()`` answering ``lib``: its chunks, or the
    ``ValueError`` it raised."""
    with mock.patch.dict(native._state, {"lib": lib}):
        try:
            return chunk_prompt(*args, **kwargs)
        except ValueError:
            return ValueError


@st.composite
def prompts(draw):
    """Tokens from a small vocabulary (so line ends and repeats occur), items that mostly tile
    without overlap (sometimes overlap, run past the end, or have no length), boundaries."""
    n = draw(st.integers(0, 400))
    tokens = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    items = []
    pos = draw(st.integers(0, 8))
    for k in range(draw(st.integers(0, 5))):
        gap = draw(st.integers(-3, 60))
        length = draw(st.sampled_from([0, 1, 5, 17, 64, -1]))
        offset = max(0, pos + gap) if draw(st.integers(0, 9)) else draw(st.integers(0, n + 5))
        items.append(MMSpan(offset, length, draw(st.text(max_size=12)) or f"item{k}",
                            draw(st.sampled_from(["image", "video", "audio"]))))
        pos = offset + max(length, 0)
    if draw(st.booleans()):
        items = list(reversed(items))  # a caller's list may come in any order
    boundaries = draw(st.lists(st.integers(-5, n + 5), max_size=6))
    return tokens, items, boundaries


@settings(max_examples=150, deadline=None)
@given(
    prompt=prompts(),
    chunk_size=st.sampled_from([1, 3, 16, 64, 256]),
    text_chunking=st.sampled_from(["content", "fixed"]),
    line_ends=st.sampled_from([frozenset(), frozenset({7}), frozenset({0, 3, 39})]),
    anchor=st.sampled_from([(), (1, 2), (5,)]),
)
def test_the_layout_is_the_definition_s_through_every_binding(
    bindings, prompt, chunk_size, text_chunking, line_ends, anchor
):
    tokens, items, boundaries = prompt
    if anchor and len(tokens) > len(anchor) and tokens[: len(anchor)] != list(anchor):
        tokens = [*anchor, *tokens[len(anchor):]]  # some prompts start with the anchor
    args = (tokens, items, chunk_size, CTX)
    kwargs = dict(anchor_ids=anchor, boundaries=boundaries, text_chunking=text_chunking,
                  line_end_ids=line_ends)
    want = _chunked(None, *args, **kwargs)
    for lib in bindings:
        assert _chunked(lib, *args, **kwargs) == want
    if want is not ValueError:
        # Independent of the keys: the chunks tile the prompt as split_spans cuts it.
        spans = split_spans(len(tokens), items, chunk_size,
                            anchor_len=len(anchor) if want and want[0].is_anchor else 0,
                            boundaries=boundaries,
                            token_ids=tokens if text_chunking == "content" else None,
                            line_end_ids=line_ends)
        assert [(c.start, c.length, c.mm_identifier) for c in want] == [
            (s.start, s.length, None if s.mm is None else s.mm.identifier) for s in spans
        ]


def test_items_that_overlap_are_refused_by_every_binding(bindings):
    tokens = list(range(50))
    items = [MMSpan(10, 20, "a"), MMSpan(25, 5, "b")]
    for lib in [*bindings, None]:
        with mock.patch.dict(native._state, {"lib": lib}):
            with pytest.raises(ValueError, match="overlaps"):
                chunk_prompt(tokens, items, 16, CTX)


def test_the_module_lays_the_prompt_out_without_the_python_split(bindings, monkeypatch):
    """What the comparison above compares: through the extension module no Python split runs."""
    if native.python_include() is None:
        pytest.skip("no Python headers: no extension module")
    from orbitkv.connector import chunking

    tokens = [1, 2, *range(10, 200)]
    items = [MMSpan(40, 30, "img", "image")]
    want = _chunked(None, tokens, items, 32, CTX, anchor_ids=(1, 2), line_end_ids=frozenset({15}))
    monkeypatch.setattr(chunking, "split_spans", mock.Mock(side_effect=AssertionError("split")))
    got = _chunked(bindings[0], tokens, items, 32, CTX, anchor_ids=(1, 2),
                   line_end_ids=frozenset({15}))
    assert got == want and got[0].is_anchor and got[1].is_canonical_slot
    assert [c.modality for c in got if c.is_mm] == ["image"]


def test_the_module_reads_vllm_s_list_itself_as_it_reads_an_array(bindings, monkeypatch):
    """vLLM's prompt is a list of ints: the module converts it (no ``array('q')`` made in Python)
    and lays it out as it lays out the same ids in an array."""
    if native.python_include() is None:
        pytest.skip("no Python headers: no extension module")
    from array import array

    from orbitkv.connector import chunking

    tokens = [(i * 7919) % 50_000 for i in range(1_800)]
    items = [MMSpan(100, 300, "img0", "image"), MMSpan(900, 300, "img1", "image")]
    kwargs = dict(line_end_ids=frozenset({0, 13}))
    from_array = _chunked(bindings[0], array("q", tokens), items, 256, CTX, **kwargs)
    definition = _chunked(None, array("q", tokens), items, 256, CTX, **kwargs)
    monkeypatch.setattr(chunking, "prompt_tokens", mock.Mock(side_effect=AssertionError("array")))
    from_list = _chunked(bindings[0], tokens, items, 256, CTX, **kwargs)
    assert from_list == from_array == definition
    assert len(from_list) > 4


@pytest.mark.parametrize("tokens", [[1, 2, "3"], [1, 2**63], [1.0, 2], [1, None]])
def test_a_list_the_module_cannot_read_is_refused_as_the_definition_refuses_it(bindings, tokens):
    """Not an int64 each: the module gives up and the Python path says what is wrong."""
    with mock.patch.dict(native._state, {"lib": None}):
        with pytest.raises((TypeError, ValueError, OverflowError)) as want:
            chunk_prompt(tokens, [], 16, CTX)
    for lib in bindings:
        with mock.patch.dict(native._state, {"lib": lib}):
            with pytest.raises(want.type):
                chunk_prompt(tokens, [], 16, CTX)


def test_the_module_reads_ints_only_and_runs_no_python_code(bindings):
    """An object with ``__index__`` is refused before anything calls it (it could resize the list
    the module is reading)."""
    if native.python_include() is None:
        pytest.skip("no Python headers: no extension module")
    from orbitkv.connector.chunk_keys import layout_keys

    calls = []

    class Index:
        def __index__(self) -> int:
            calls.append(1)
            tokens.clear()
            return 5

    tokens = [1, 2, Index(), *range(100)]
    with mock.patch.dict(native._state, {"lib": bindings[0]}):
        laid_out = layout_keys("fp", "cpu_vec", "t", tokens, [], [], anchor_len=0, chunk_size=16,
                               is_content=False, line_end_table=b"")
    assert laid_out is None and calls == [] and len(tokens) == 103
