"""``entry_decode._as_tensors``: an entry's tensors as views of its bytes, runs of one shape and
dtype at a constant step built as one view and unbound. Each tensor must be the view one
``as_strided`` per tensor gives (same address, shape, strides, values), whatever the layout."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from orbitkv.store.entry_decode import _as_tensors
from orbitkv.store.entry_format import TensorSpec

DTYPES = (torch.bfloat16, torch.float32, torch.int64)


def _one_view_each(storage, specs):
    out = {}
    for spec in specs:
        size = spec.dtype.itemsize
        base = storage[: storage.numel() // size * size].view(spec.dtype)
        strides = [1] * len(spec.shape)
        for d in range(len(spec.shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * max(spec.shape[d + 1], 1)
        out[spec.name] = base.as_strided(spec.shape, tuple(strides), spec.begin // size)
    return out


@settings(max_examples=200, deadline=None)
@given(
    layout=st.lists(
        st.tuples(
            st.sampled_from(range(len(DTYPES))),
            st.sampled_from([(3, 2), (3, 2, 4), (0, 2), (5,), (1, 1)]),
            st.integers(0, 3),  # repeats of this tensor kind at a constant step
            st.integers(0, 2),  # gap after each, in 8-byte units
        ),
        min_size=1, max_size=6,
    ),
    seed=st.integers(0, 1000),
)
def test_views_are_the_one_view_per_tensor(layout, seed):
    specs, pos = [], 0
    for n, (dtype_i, shape, repeats, gap) in enumerate(layout):
        dtype = DTYPES[dtype_i]
        nbytes = math.prod(shape) * dtype.itemsize
        for r in range(repeats + 1):
            specs.append(TensorSpec(f"t{n}.{r}", dtype, shape, pos, pos + nbytes))
            pos += -(-nbytes // 8) * 8 + 8 * gap
    order = np.random.default_rng(seed).permutation(len(specs))
    specs = [specs[i] for i in order]  # the caller's order need not be the bytes' order
    storage = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, pos + 8, np.uint8))
    got = _as_tensors(storage, {s.name: s.begin for s in specs}, specs)
    want = _one_view_each(storage, [s for s in specs if s.stop > s.begin])
    assert set(got) == {s.name for s in specs}
    for spec in specs:
        t = got[spec.name]
        assert t.dtype == spec.dtype and tuple(t.shape) == spec.shape
        if spec.stop == spec.begin:
            continue
        w = want[spec.name]
        assert (t.data_ptr(), t.stride()) == (w.data_ptr(), w.stride())
        assert t.is_contiguous() and torch.equal(t.view(torch.uint8) if t.numel() else t,
                                                 w.view(torch.uint8) if w.numel() else w)
