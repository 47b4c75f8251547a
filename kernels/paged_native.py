"""CPU_VEC load and gather through the native op (``native.py``, ``csrc/cpu_vec.cpp``), and the
CPU_AMX cache's gather (``csrc/cpu_amx.cpp``: bits copied out of the tile packing).

One pass over the chunk: each token's K row is relocated (and patched) in fp32, rounded once and
transposed into its page, its V row (patched) written beside it, for any slot mapping. The patch
product ``u @ w`` stays the reference's own torch (BLAS) call (``relocate.patch_product``, one
matmul over the chunk), so it is the very same fp32 tensor; the op adds it in the same order as
``rotate_and_patch``. The bytes therefore equal the torch reference's at any thread count
(tests/kernels/test_kernels_paged_cpu.py).

``load_native`` / ``gather_native`` return False / None when the op is unavailable (no compiler)
or disabled (``is_enabled``), and the caller takes the torch path.
"""

from __future__ import annotations

from array import array

import torch

from . import native
from .paged_layout import CacheViews, PagedLayout
from .relocate import patch_product

Patch = tuple[torch.Tensor, torch.Tensor]

# Tests switch the op off to check the torch path it stands in for.
is_enabled = True

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_STYLE_CODES = {"neox": 0, "gptj": 1}
_ERRORS = {-1: "a slot past the cache end or a bad cache geometry",
           -2: "a cache dtype the native op was built without"}


def _library(cache: torch.Tensor):
    if not is_enabled or cache.dtype not in _DTYPE_CODES or cache.device.type != "cpu":
        return None
    return native.library()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _geometry(views: CacheViews, cache: torch.Tensor) -> tuple[int, ...]:
    nb, bs, nh, hd = views.shape
    return nb, nh, bs, hd, cache.stride(0), cache.stride(1)


def _many_op(lib, views: CacheViews, op: str):
    """``orbitkv_cpu_{vec,amx}_{op}``: the CPU_AMX entry points take their CPU_VEC twins'
    arguments."""
    layout = "amx" if views.layout is PagedLayout.CPU_AMX else "vec"
    return getattr(lib, f"orbitkv_cpu_{layout}_{op}"), f"{views.layout.name} {op}"


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ValueError(f"native {what} refused the call: {_ERRORS.get(rc, rc)}")


def load_native(views: CacheViews, cache, slots, k, v, cos, sin, spec, patch_k: Patch | None,
                patch_v: Patch | None) -> bool:
    """The fused load; False when the op is not available. ``slots`` may hold padding (-1)."""
    lib = _library(cache)
    if lib is None:
        return False
    has_patch = patch_k is not None or patch_v is not None
    if has_patch and bool((slots < 0).any()):
        # Dropped before any arithmetic, as the reference does: the patch product must be taken
        # over the same rows. Without a patch the op skips padding itself.
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
        cos = cos if cos is None or cos.shape[0] == 1 else cos[keep]
        sin = sin if sin is None or sin.shape[0] == 1 else sin[keep]
        patch_k = None if patch_k is None else (patch_k[0][keep], patch_k[1])
        patch_v = None if patch_v is None else (patch_v[0][keep], patch_v[1])
    n = int(k.shape[0])
    if n == 0:
        return True
    k, v, slots = k.contiguous(), v.contiguous(), slots.contiguous()
    if cos is not None:
        cos, sin = cos.contiguous(), sin.contiguous()
        rope = (spec.rope_offset, spec.rotary_dim, _STYLE_CODES[spec.style])
    else:
        rope = (0, 0, 0)
    cos_rows = 0 if cos is None else int(cos.shape[0])
    prod_k = None if patch_k is None else patch_product(*patch_k)
    prod_v = None if patch_v is None else patch_product(*patch_v)
    rc = lib.orbitkv_cpu_vec_load(
        cache.data_ptr(), *_geometry(views, cache), _DTYPE_CODES[cache.dtype],
        k.data_ptr(), v.data_ptr(), n, slots.data_ptr(),
        _ptr(cos), _ptr(sin), cos_rows, *rope, _ptr(prod_k), _ptr(prod_v),
        torch.get_num_threads())
    _check(rc, "CPU_VEC load")
    return True


def int64s(values) -> array:
    """Integers as one int64 buffer, the ops' arrays of pointers and sizes (an ``array('q')``:
    a ctypes array type made per length costs several times as much on cold caches)."""
    return array("q", values)


def load_native_many(views: CacheViews, caches, ks, vs, slots, coss, sins, spec) -> bool:
    """Unpatched loads of one geometry in one call (``orbitkv_cpu_vec_load_many``, or its CPU_AMX
    twin); False when the op is not available. Arguments are checked by ``paged.load_many``."""
    lib = _library(caches[0])
    if lib is None:
        return False
    op, what = _many_op(lib, views, "load_many")
    cos_rows = [0 if c is None else int(c.shape[0]) for c in coss]
    rope = (spec.rope_offset, spec.rotary_dim, _STYLE_CODES[spec.style]) if spec else (0, 0, 0)
    rc = op(
        len(caches), int64s([c.data_ptr() for c in caches]), *_geometry(views, caches[0]),
        _DTYPE_CODES[caches[0].dtype], int64s([k.data_ptr() for k in ks]),
        int64s([v.data_ptr() for v in vs]), int64s([int(s.shape[0]) for s in slots]),
        int64s([s.data_ptr() for s in slots]), int64s([_ptr(c) or 0 for c in coss]),
        int64s([_ptr(c) or 0 for c in sins]), int64s(cos_rows), *rope,
        torch.get_num_threads())
    _check(rc, what)
    return True


def stacked_args(views: CacheViews, caches) -> tuple[int, ...] | None:
    """The stacked op's geometry and dtype arguments for these caches, made once a cache group
    (``paged_stacked.cache_group``); None where the op cannot take the caches' dtype or device."""
    first = caches[0]
    if first.dtype not in _DTYPE_CODES or first.device.type != "cpu":
        return None
    return (*_geometry(views, first), _DTYPE_CODES[first.dtype])


def load_native_stacked(group, rows, slot_ptrs, tables, spec) -> bool:
    """``load_native_many``'s op for loads of every layer at once (``rows[j]``: a
    ``paged_stacked.StackedRows``, checked there, with its slots at ``slot_ptrs[j]`` and its
    shift's ``(cos, sin, rows)`` table pointers ``tables[j]``) into ``group``'s caches (a
    ``paged_stacked.CacheGroup``: pointers and ``stacked_args`` made once): one base and layer
    step a load (``csrc/stacked.cpp`` forms the jobs, layer ``i`` of load ``j`` the
    ``i * num_loads + j``-th), instead of a pointer a layer and load formed in Python."""
    lib = native.library() if is_enabled and group.native_args is not None else None
    if lib is None:
        return False
    op, what = _many_op(lib, group.views, "load_stacked")
    # Nine fields a load, field-major (stacked.cpp's ``loads``).
    loads = int64s([
        *[r.k_ptr for r in rows], *[r.k_step for r in rows],
        *[r.v_ptr for r in rows], *[r.v_step for r in rows],
        *[r.num_tokens for r in rows], *slot_ptrs,
        *[t[0] for t in tables], *[t[1] for t in tables], *[t[2] for t in tables],
    ])
    rope = (spec.rope_offset, spec.rotary_dim, _STYLE_CODES[spec.style]) if spec else (0, 0, 0)
    rc = op(len(group.caches), group.pointers, *group.native_args, len(rows), loads, *rope,
            torch.get_num_threads())
    _check(rc, what)
    return True


def gather_native_many(views: CacheViews, caches, slots, num_threads: int | None = None
                       ) -> torch.Tensor | None:
    """The tokens at ``slots`` of every cache, ``[len(caches), 2, N, H, D]`` (K then V), from a
    CPU_VEC or CPU_AMX cache; None when the op is not available. ``slots`` must not hold
    padding."""
    lib = _library(caches[0])
    if lib is None:
        return None
    op, what = _many_op(lib, views, "gather_many")
    nb, bs, nh, hd = views.shape
    n = int(slots.shape[0])
    out = torch.empty(len(caches), 2, n, nh, hd, dtype=caches[0].dtype)
    # Held by a name for the call: the op reads through its pointer.
    slots = slots.contiguous()
    if n:
        rc = op(
            len(caches), int64s([c.data_ptr() for c in caches]), *_geometry(views, caches[0]),
            caches[0].element_size(), int64s([t.data_ptr() for t in out[:, 0]]),
            int64s([t.data_ptr() for t in out[:, 1]]), n, slots.data_ptr(),
            torch.get_num_threads() if num_threads is None else num_threads)
        _check(rc, what)
    return out


def gather_native(views: CacheViews, cache, slots) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Tokens back as contiguous ``(k, v)`` ``[N, H, D]`` (negative slots read as zeros)."""
    lib = _library(cache)
    if lib is None:
        return None
    nb, bs, nh, hd = views.k.shape
    n = int(slots.shape[0])
    slots = slots.contiguous()
    alloc = torch.zeros if bool((slots < 0).any()) else torch.empty
    k = alloc(n, nh, hd, dtype=cache.dtype)
    v = alloc(n, nh, hd, dtype=cache.dtype)
    if n:
        rc = lib.orbitkv_cpu_vec_gather(cache.data_ptr(), *_geometry(views, cache),
                                        cache.element_size(), k.data_ptr(), v.data_ptr(), n,
                                        slots.data_ptr(), torch.get_num_threads())
        _check(rc, "CPU_VEC gather")
    return k, v
