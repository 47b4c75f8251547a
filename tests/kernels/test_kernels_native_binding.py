"""The native library's two bindings (``kernels/native.py``): the CPython extension module where
this Python's headers are installed, ``ctypes`` without them. Both take the same arguments (a
pointer as an address, None or a buffer) and must write the same bytes; the module refuses a
wrong call with a ``TypeError`` naming the entry point, never a crash."""

from __future__ import annotations

from array import array

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from orbitkv.kernels import native
from orbitkv.kernels.paged import PagedLayout
from orbitkv.kernels.paged_stacked import cache_group, load_stacked

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C++ compiler on PATH")

NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, DIM = 3, 6, 2, 16, 32


@pytest.fixture(scope="module")
def bindings(tmp_path_factory):
    """``(module, ctypes)``: the library as each binding loads it, each built in its own folder
    (the ctypes one as on a machine without the Python headers)."""
    if native.python_include() is None:
        pytest.skip("this Python has no headers: only the ctypes binding exists here")
    module = native._load(native.build(tmp_path_factory.mktemp("module")))
    saved = native.python_include
    native.python_include = lambda: None
    try:
        plain = native._load(native.build(tmp_path_factory.mktemp("plain")))
    finally:
        native.python_include = saved
    assert type(module).__name__ == "module" and type(plain).__name__ == "CDLL"
    return module, plain


def _cuts(lib, tokens: list[int], stretches: list[tuple[int, int]]) -> list[int]:
    toks = array("q", tokens)
    bounds = array("q", [s for s, _ in stretches] + [e for _, e in stretches])
    cuts = array("q", bytes(8 * (len(tokens) + 1)))
    table = bytes([0, 0, 1, 0])  # token 1 ends a line
    n = lib.orbitkv_cdc_cuts(toks, bounds, table, cuts.buffer_info()[0], len(tokens),
                             len(stretches), 4, 4, 16, len(table), 3)
    assert n >= 0
    return cuts[:n].tolist()


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=120), data=st.data())
def test_the_cuts_are_the_same_through_either_binding(bindings, tokens, data):
    split = data.draw(st.integers(0, len(tokens)))
    stretches = [(0, split), (split, len(tokens))] if 0 < split < len(tokens) else [
        (0, len(tokens))]
    module, plain = bindings
    assert _cuts(module, tokens, stretches) == _cuts(plain, tokens, stretches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stacked_load_writes_the_same_bytes_through_either_binding(bindings, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    n = 20
    k = torch.randn(NUM_LAYERS, n, HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(NUM_LAYERS, n, HEADS, DIM, generator=gen).to(dtype)
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=gen)[:n]
    out = []
    for lib in bindings:
        monkeypatch.setitem(native._state, "lib", lib)
        caches = [torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=dtype)
                  for _ in range(NUM_LAYERS)]
        group = cache_group(caches, PagedLayout.CPU_VEC)
        assert load_stacked(group, PagedLayout.CPU_VEC, [slots], [k], [v], spec=None, deltas=[0])
        out.append(torch.stack(caches))
    assert out[0].abs().sum() > 0
    assert torch.equal(out[0].view(torch.uint8), out[1].view(torch.uint8))


def test_the_module_refuses_a_wrong_call_by_name(bindings):
    module, _ = bindings
    with pytest.raises(TypeError, match="orbitkv_cdc_cuts takes 11 arguments, got 2"):
        module.orbitkv_cdc_cuts(0, 0)
    with pytest.raises(TypeError):  # a str is neither an address nor a buffer
        module.orbitkv_cdc_cuts("tokens", None, b"", None, 0, 0, 4, 4, 16, 0, 3)
    with pytest.raises(TypeError, match="argument 4 is not a valid integer"):
        module.orbitkv_cdc_cuts(None, None, b"", None, "many", 0, 4, 4, 16, 0, 3)
    assert module.orbitkv_native_version() == native.VERSION
