"""Loads that bring every layer of a chunk at once, in one native call (``csrc/stacked.cpp``).

A step's loads are what a worker does between two forward passes, on cold caches, where each
tensor attribute read costs microseconds. So the work is split by how often it must happen:

- ``cache_group``: the model's layer caches, checked once when the worker registers them (vLLM
  never moves them);
- ``stacked_rows``: one load's K and V of every layer, checked against the group once and kept as
  the op's pointers and steps; a worker keeps them for an entry it loads again and again (the
  memory tier's buffers never change);
- ``load_stacked_rows``: a step's loads, with their slot mappings (an ``array('q')`` as the
  scheduler ships it, or an int64 tensor) and shifts.

``load_stacked`` does all three for one call. The bytes equal ``paged.load_many``'s with job
``(i, j)`` = layer ``i`` of load ``j``.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .paged import _check_many_slots, _many_views, _shared_cos_sin
from .paged_layout import CacheViews, PagedLayout
from .paged_native import int64s, load_native_stacked, stacked_args
from .relocate import check_spec
from .rope import RopeSpec

__all__ = [
    "CacheGroup", "StackedRows", "cache_group", "load_stacked", "load_stacked_rows",
    "stacked_rows",
]


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """A model's layer caches checked once for ``load_stacked``: the first cache's views, the
    check that every cache shares its geometry, and the caches' pointers for the op. vLLM
    allocates the caches when the engine starts and never moves them, so a worker makes this
    once (``cache_group``), not once a step (in a cold harness of 16 layers, that work cost
    0.1-0.2 ms a loading step: ``docs/performance.md``, tenth session)."""

    caches: tuple[torch.Tensor, ...]
    layout: PagedLayout
    # None: one native call cannot take these caches (``load_stacked`` returns False).
    views: CacheViews | None
    # The caches' data pointers as the op's int64 array (None without views).
    pointers: Any
    # The op's geometry and dtype arguments (``paged_native.stacked_args``; None without views).
    native_args: tuple[int, ...] | None = None


def cache_group(caches: Sequence[torch.Tensor], layout: PagedLayout | str) -> CacheGroup:
    """``caches`` (a model's layers in order) prepared for ``load_stacked``; raises ValueError
    where they differ in geometry, as ``load_stacked`` would."""
    if not caches:
        raise ValueError("a cache group needs caches")
    layout = PagedLayout.parse(layout)
    views = _many_views(caches, layout)
    if views is None:
        return CacheGroup(tuple(caches), layout, None, None)
    pointers = int64s([c.data_ptr() for c in caches])
    return CacheGroup(tuple(caches), layout, views, pointers, stacked_args(views, caches))


@dataclass(frozen=True, slots=True)
class StackedRows:
    """One load's K and V of every layer as the op reads them (``stacked_rows``): a base pointer
    and a layer step (bytes) a side, and the tokens a layer. ``k`` and ``v`` are held so the
    memory the pointers name stays alive."""

    k: torch.Tensor
    v: torch.Tensor
    num_tokens: int
    k_ptr: int
    k_step: int
    v_ptr: int
    v_step: int


def stacked_rows(group: CacheGroup, k: torch.Tensor, v: torch.Tensor) -> StackedRows:
    """``k``, ``v`` (``[len(group.caches), n, H, D]`` in the cache dtype, each layer's rows
    contiguous, any layer stride: an entry's K of every layer as one view) checked against the
    group; raises ValueError naming what does not fit."""
    views = group.views
    if views is None:
        raise ValueError(f"one native call cannot take {group.layout} caches")
    first = group.caches[0]
    dtype, num_heads, head_dim = first.dtype, views.num_kv_heads, views.head_dim
    row = (num_heads * head_dim, head_dim, 1)
    n = k.shape[1] if k.dim() == 4 else -1
    want = (len(group.caches), n, num_heads, head_dim)
    for name, x in (("k", k), ("v", v)):
        if (x.dtype != dtype or x.shape != want or x.stride()[1:] != row
                or x.stride(0) < 0 or not x.is_cpu):
            raise ValueError(
                f"{name} must be a {list(want)} {dtype} CPU tensor with contiguous layers, "
                f"got {tuple(x.shape)} {x.dtype} strides {x.stride()} on {x.device}")
    item = first.element_size()
    return StackedRows(k, v, n, k.data_ptr(), k.stride(0) * item, v.data_ptr(),
                       v.stride(0) * item)


def load_stacked_rows(
    group: CacheGroup,
    rows: Sequence[StackedRows],
    slots: Sequence[torch.Tensor | array],
    *,
    spec: RopeSpec | None,
    deltas: Sequence[int],
) -> bool:
    """Load ``j`` writes layer ``i`` of ``rows[j]`` at ``slots[j]`` of ``group.caches[i]``, K
    moved by ``deltas[j]``. ``slots[j]``: ``rows[j].num_tokens`` int64 slots, an ``array('q')``
    or a contiguous 1-D CPU tensor (-1 is skipped; every slot is bounds-checked before anything
    is written). False, writing nothing, where the op cannot run."""
    if not (len(rows) == len(slots) == len(deltas)):
        raise ValueError("load_stacked needs one slot mapping, k, v and delta per load")
    views = group.views
    if views is None:
        return False
    caches = group.caches
    if caches[0].data_ptr() != group.pointers[0]:
        raise ValueError("the caches moved since their group was made: make it again")
    tensors = [s for s in slots if not isinstance(s, array)]
    if tensors:
        _check_many_slots(tensors)
    slot_ptrs = []
    for s, r in zip(slots, rows, strict=True):
        if isinstance(s, array):
            if s.typecode != "q":
                raise TypeError(f"a slot array must be array('q'), got array({s.typecode!r})")
            ptr, num = s.buffer_info()
        else:
            ptr, num = s.data_ptr(), s.shape[0]
        if num != r.num_tokens:
            raise ValueError(f"a load of {r.num_tokens} tokens given {num} slots")
        slot_ptrs.append(ptr)
    if any(deltas):
        if spec is None:
            raise ValueError("a non-zero delta needs the model's RopeSpec (spec=...)")
        tables = [_rope_table(spec, int(d), views.head_dim) for d in deltas]
    else:
        tables = [_NO_SHIFT] * len(deltas)
    return load_native_stacked(group, rows, slot_ptrs, tables, spec)


# A load that keeps its positions: no table (the op's null pointers).
_NO_SHIFT = (0, 0, 0)


@functools.lru_cache(maxsize=256)
def _rope_table(spec: RopeSpec, delta: int, head_dim: int) -> tuple[Any, ...]:
    """``(cos pointer, sin pointer, rows)`` of one shift's CPU tables as the op takes them (the
    tables held after them, so the pointers stay valid): a step's loads cost a lookup each, not
    tensor reads on cold caches."""
    if not delta:
        return _NO_SHIFT
    check_spec(spec, head_dim, "k")
    cos, sin = _shared_cos_sin(spec, delta, torch.device("cpu"))
    return cos.data_ptr(), sin.data_ptr(), int(cos.shape[0]), cos, sin


def load_stacked(
    caches: Sequence[torch.Tensor] | CacheGroup,
    layout: PagedLayout | str,
    slots: Sequence[torch.Tensor | array],
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    *,
    spec: RopeSpec | None,
    deltas: Sequence[int],
) -> bool:
    """``paged.load_many`` for loads that bring every layer at once: load ``j`` writes
    ``ks[j][i]``, ``vs[j][i]`` at ``slots[j]`` of ``caches[i]``, K moved by ``deltas[j]``
    (``stacked_rows`` and ``load_stacked_rows`` in one call). ``caches``: a ``CacheGroup``, or
    the layers' caches (checked here).

    False, writing nothing, where ``load_many`` returns False; raises as it does."""
    if not caches or not (len(ks) == len(vs) == len(deltas) == len(slots)):
        raise ValueError("load_stacked needs caches and one slot mapping, k, v and delta per load")
    group = caches if isinstance(caches, CacheGroup) else cache_group(caches, layout)
    if group.layout is not PagedLayout.parse(layout):
        raise ValueError(f"a cache group of {group.layout} given as {layout}")
    if group.views is None:
        return False
    rows = [stacked_rows(group, k, v) for k, v in zip(ks, vs, strict=True)]
    return load_stacked_rows(group, rows, slots, spec=spec, deltas=deltas)
