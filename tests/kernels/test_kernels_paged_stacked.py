"""``load_stacked``: a step's loads with every layer of a load as one ``[L, n, H, D]`` view (an
entry's K of every layer laid out as one run), in one native call (``paged.py``,
``paged_native.py``), against the torch reference one layer and load at a time."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_testlib import make_spec
from orbitkv.kernels import native
from orbitkv.kernels.paged import load_chunk
from orbitkv.kernels.paged_stacked import cache_group, load_stacked

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="native CPU kernels unavailable (no C++ compiler)")

# CPU_AMX packs bf16 tiles of 32-token blocks; CPU_VEC takes any block size and dtype.
GEOMETRY = {"cpu_vec": (16, 2, 32), "cpu_amx": (32, 2, 64)}
NUM_BLOCKS, NUM_LAYERS = 24, 3


def _stacks(gen, lengths, heads, dim, dtype, gap, lo):
    """Per load, K and V of every layer as one view over a wider buffer: ``gap`` spare elements
    between two layers' rows, the load's rows starting ``lo`` rows into each layer's."""
    out = []
    for n in lengths:
        layer = (lo + n) * heads * dim + gap
        pair = []
        for _ in range(2):
            buf = torch.randn(NUM_LAYERS * layer, generator=gen).to(dtype)
            full = buf.as_strided((NUM_LAYERS, lo + n, heads, dim),
                                  (layer, heads * dim, dim, 1))
            pair.append(full[:, lo:])
        out.append(tuple(pair))
    return out


def _slots(gen, block_size, lengths, *, padded):
    free = torch.randperm(NUM_BLOCKS * block_size, generator=gen)
    out, at = [], 0
    for n in lengths:
        s = free[at : at + n].clone()
        at += n
        if padded and n > 1:
            s[1] = -1
        out.append(s)
    return out


@settings(max_examples=25, deadline=None)
@given(layout=st.sampled_from(sorted(GEOMETRY)), is_fp32=st.booleans(), padded=st.booleans(),
       lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       gap=st.integers(0, 70), lo=st.integers(0, 5),
       deltas=st.lists(st.sampled_from([0, 0, 7, -300]), min_size=4, max_size=4),
       seed=st.integers(0, 2**16), is_grouped=st.booleans())
def test_load_stacked_writes_the_bytes_of_the_reference_per_layer_and_load(
    layout, is_fp32, padded, lengths, gap, lo, deltas, seed, is_grouped
):
    dtype = torch.float32 if is_fp32 and layout == "cpu_vec" else torch.bfloat16
    block_size, heads, dim = GEOMETRY[layout]
    spec = make_spec("neox", dim, dim)
    gen = torch.Generator().manual_seed(seed)
    stacks = _stacks(gen, lengths, heads, dim, dtype, gap, lo)
    slots = _slots(gen, block_size, lengths, padded=padded)
    deltas = deltas[: len(lengths)]
    want = [torch.randn(NUM_BLOCKS, heads, block_size, 2 * dim, generator=gen).to(dtype)
            for _ in range(NUM_LAYERS)]
    got = [c.clone() for c in want]
    for li in range(NUM_LAYERS):
        for (k, v), s, d in zip(stacks, slots, deltas, strict=True):
            load_chunk(want[li], s, layout, k[li].contiguous(), v[li].contiguous(), spec=spec,
                       delta=d, backend="torch")
    # A worker's caches checked once (``cache_group``) or the list checked in the call.
    caches = cache_group(got, layout) if is_grouped else got
    assert load_stacked(caches, layout, slots, [k for k, _ in stacks], [v for _, v in stacks],
                        spec=spec, deltas=deltas)
    for li, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), f"layer {li}"


def _case(dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    block_size, heads, dim = GEOMETRY["cpu_vec"]
    lengths = [5, 9]
    stacks = _stacks(gen, lengths, heads, dim, dtype, 4, 1)
    caches = [torch.zeros(NUM_BLOCKS, heads, block_size, 2 * dim, dtype=dtype)
              for _ in range(NUM_LAYERS)]
    return caches, _slots(gen, block_size, lengths, padded=False), stacks


def test_load_stacked_refuses_bad_arguments_before_writing():
    caches, slots, stacks = _case()
    ks, vs = [k for k, _ in stacks], [v for _, v in stacks]
    spec = make_spec("neox", 32, 32)
    with pytest.raises(ValueError, match="contiguous layers"):
        load_stacked(caches, "cpu_vec", slots, [k.transpose(2, 3).contiguous().transpose(2, 3)
                                                for k in ks], vs, spec=spec, deltas=[0, 0])
    with pytest.raises(ValueError, match="contiguous layers"):  # one layer short
        load_stacked(caches, "cpu_vec", slots, [k[1:] for k in ks], vs, spec=spec, deltas=[0, 0])
    with pytest.raises(ValueError, match="contiguous layers"):
        load_stacked(caches, "cpu_vec", slots, [k.double() for k in ks], vs, spec=spec,
                     deltas=[0, 0])
    with pytest.raises(ValueError, match="one slot mapping"):
        load_stacked(caches, "cpu_vec", slots[:1], ks, vs, spec=spec, deltas=[0, 0])
    with pytest.raises(TypeError, match="int64"):
        load_stacked(caches, "cpu_vec", [s.int() for s in slots], ks, vs, spec=spec,
                     deltas=[0, 0])
    with pytest.raises(ValueError, match="RopeSpec"):
        load_stacked(caches, "cpu_vec", slots, ks, vs, spec=None, deltas=[0, 5])
    past = [slots[0], slots[1].clone()]
    past[1][-1] = NUM_BLOCKS * GEOMETRY["cpu_vec"][0]
    with pytest.raises(ValueError, match="past the cache end"):
        load_stacked(caches, "cpu_vec", past, ks, vs, spec=spec, deltas=[0, 0])
    assert not any(bool(c.any()) for c in caches)


def test_load_stacked_declines_caches_the_op_cannot_take():
    _, slots, stacks = _case()
    flash = [torch.zeros(NUM_BLOCKS, 2, 16, 2, 32) for _ in range(NUM_LAYERS)]
    assert load_stacked(flash, "flash", slots, [k for k, _ in stacks], [v for _, v in stacks],
                        spec=None, deltas=[0, 0]) is False
    assert not any(bool(c.any()) for c in flash)


def test_a_cache_group_is_checked_once_and_refuses_what_the_call_would():
    caches, slots, stacks = _case()
    ks, vs = [k for k, _ in stacks], [v for _, v in stacks]
    spec = make_spec("neox", 32, 32)
    group = cache_group(caches, "cpu_vec")
    assert group.views is not None and list(group.pointers) == [c.data_ptr() for c in caches]
    with pytest.raises(ValueError, match="caches differ"):
        cache_group([*caches[:-1], caches[-1][:-1]], "cpu_vec")
    with pytest.raises(ValueError, match="needs caches"):
        cache_group([], "cpu_vec")
    with pytest.raises(ValueError, match="given as"):
        load_stacked(group, "cpu_amx", slots, ks, vs, spec=spec, deltas=[0, 0])
    moved = dataclasses.replace(group, caches=tuple(c.clone() for c in caches))
    with pytest.raises(ValueError, match="moved"):
        load_stacked(moved, "cpu_vec", slots, ks, vs, spec=spec, deltas=[0, 0])
    assert all(not c.any() for c in caches), "a refused call wrote nothing"
    assert load_stacked(group, "cpu_vec", slots, ks, vs, spec=spec, deltas=[0, 0])
    assert all(c.any() for c in caches)


def test_rows_checked_once_load_again_with_slots_as_the_scheduler_ships_them():
    """``stacked_rows`` once, ``load_stacked_rows`` every step: slots as an ``array('q')`` (what
    the scheduler ships) write the bytes ``load_stacked`` writes from int64 tensors."""
    from array import array

    from orbitkv.kernels.paged_stacked import load_stacked_rows, stacked_rows

    caches, slots, stacks = _case(torch.bfloat16)
    want = [c.clone() for c in caches]
    spec = make_spec("neox", 32, 32)
    ks, vs = [k for k, _ in stacks], [v for _, v in stacks]
    assert load_stacked(want, "cpu_vec", slots, ks, vs, spec=spec, deltas=[7, 0])
    group = cache_group(caches, "cpu_vec")
    rows = [stacked_rows(group, k, v) for k, v in stacks]
    shipped = [array("q", s.tolist()) for s in slots]
    with pytest.raises(TypeError, match="array\\('q'\\)"):
        load_stacked_rows(group, rows, [array("l", [0] * 5), shipped[1]], spec=spec, deltas=[7, 0])
    with pytest.raises(ValueError, match="given 4 slots"):
        load_stacked_rows(group, rows, [shipped[0][:4], shipped[1]], spec=spec, deltas=[7, 0])
    with pytest.raises(ValueError, match="contiguous layers"):
        stacked_rows(group, ks[0].double(), vs[0])
    assert all(not c.any() for c in caches), "a refused call wrote nothing"
    assert load_stacked_rows(group, rows, shipped, spec=spec, deltas=[7, 0])
    for got, w in zip(caches, want, strict=True):
        assert torch.equal(got.view(torch.uint8), w.view(torch.uint8))
    # The same rows again, with a tensor for one load's slots and other shifts.
    again = [c.clone() for c in caches]
    assert load_stacked(again, "cpu_vec", slots, ks, vs, spec=spec, deltas=[0, -3])
    assert load_stacked_rows(group, rows, [slots[0], shipped[1]], spec=spec, deltas=[0, -3])
    for got, w in zip(caches, again, strict=True):
        assert torch.equal(got.view(torch.uint8), w.view(torch.uint8))
