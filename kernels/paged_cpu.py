"""Fast CPU path of the paged load/gather for vLLM's ``CPU_VEC`` cache (the production CPU layout).

A CPU_VEC page holds, per ``(block, head)``, K transposed (``[D, block_size]``) then V as rows
(``[block_size, D]``). A chunk normally covers a (possibly partial) first block, then whole blocks
in order, then a partial last block. The whole blocks ("slabs") are written page by page:

1. K is transposed bit for bit into its page layout, straight into the cache when the slab's
   blocks are consecutive, else into a reused staging buffer;
2. the rotary band is recomputed in place there in fp32 and rounded once:
   ``round(x*cos -+ partner*sin)``, the same fp32 products and sums as ``rotate_fp32``, so the
   bytes equal the reference; features outside the band are never widened to fp32. With a
   patch (which touches every feature) the whole chunk is formed token-major by one
   ``rotate_and_patch`` call first, the reference's own call: the patch product is a BLAS matmul,
   and under several threads a matmul over part of the rows can round differently;
3. staged pages go to their blocks with one ``index_copy_`` on a 64-bit view of the cache (whole
   page rows; the bf16 ``index_copy_`` kernel is ~5x slower per byte). V pages are plain row copies
   (also via 64-bit views).

Tokens outside whole blocks (and any mapping that is not block-shaped) are relocated into a
contiguous buffer and written by vLLM's own writer ``cpu_attn_reshape_and_cache`` when vLLM is
importable, else by advanced indexing on the strided views.
"""

from __future__ import annotations

import threading

import torch

from ._common import vllm_cpu_writer
from .paged_layout import CacheViews, PagedLayout
from .paged_native import gather_native, load_native
from .relocate import rotate_and_patch

Patch = tuple[torch.Tensor, torch.Tensor]

# fp32 elements recomputed per step (1 MiB): few enough that the step's temporaries stay in L2/L3,
# many enough that the per-op dispatch cost (~10 ops a step) stays small.
_STEP_ELEMS = 1 << 18

_local = threading.local()


def _buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A reused, uninitialised per-thread buffer (new allocations of multi-MB buffers page-fault).

    Each buffer starts at its own offset modulo 4 KiB: the step buffers are page-sized multiples,
    and out-of-place ops whose inputs and output share their low address bits stall on 4K
    aliasing (measured 2x on the rotation's ``out=`` multiplies).

    Allocated outside inference mode: vLLM loads inside ``torch.inference_mode()``, and an
    inference tensor kept in the pool would refuse in-place writes from a later caller outside it.
    """
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    numel = 1
    for s in shape:
        numel *= s
    entry = pool.get((name, dtype))
    if entry is None or entry[1] < numel:
        slot = len(pool) if entry is None else entry[2]
        itemsize = torch.empty((), dtype=dtype).element_size()
        skew = (slot * 528) % 4096 // itemsize
        with torch.inference_mode(False):
            storage = torch.empty(numel + 4096 // itemsize, dtype=dtype)
        entry = pool[(name, dtype)] = (storage[skew:], numel, slot)
    return entry[0][:numel].view(shape)


def _word_dtype(nbytes: int) -> torch.dtype:
    """Widest integer dtype whose size divides ``nbytes`` (bit copies in wide words run faster)."""
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0:
            return dt
    return torch.uint8


def is_cpu_vec_fast(views: CacheViews, cache: torch.Tensor) -> bool:
    if views.layout is not PagedLayout.CPU_VEC or cache.device.type != "cpu":
        return False
    nb, bs, nh, hd = views.k.shape
    return cache.stride() == (nh * bs * 2 * hd, bs * 2 * hd, 2 * hd, 1)


def split_blocks(slots: torch.Tensor, block_size: int) -> tuple[int, int, torch.Tensor | None]:
    """``(head, num_pages, blocks)``: tokens ``[head, head + num_pages*block_size)`` fill whole
    blocks ``blocks`` in order; the rest is left to the generic writer. ``blocks`` None: no slab."""
    n = int(slots.shape[0])
    if n == 0:
        return 0, 0, None
    head = min(n, (-int(slots[0])) % block_size) if int(slots[0]) >= 0 else 0
    num_pages = (n - head) // block_size
    if num_pages == 0:
        return head, 0, None
    mid = slots[head : head + num_pages * block_size].view(num_pages, block_size)
    first = mid[:, 0]
    expected = first[:, None] + torch.arange(block_size, dtype=slots.dtype)
    if bool((first % block_size != 0).any()) or not torch.equal(mid, expected):
        return 0, 0, None
    return head, num_pages, first // block_size


def _consecutive(blocks: torch.Tensor) -> int | None:
    """First block id when ``blocks`` is a consecutive increasing run, else None."""
    b0 = int(blocks[0])
    n = int(blocks.shape[0])
    if n == 1 or (int(blocks[-1]) - b0 == n - 1 and bool((blocks.diff() == 1).all())):
        return b0
    return None


def _rotate_pages(kt, cos, sin, spec):
    """Rotate the band of ``kt`` ``[P, H, D, bs]`` (transposed K pages, cache dtype) in place.

    ``cos``/``sin``: ``[1 or P*bs, half]`` fp32, rows in slab token order. Works in page steps into
    reused fp32 buffers, so no step allocates; features outside the band are not touched.
    """
    num_pages, nh, hd, bs = kt.shape
    step = max(1, _STEP_ELEMS // (nh * hd * bs))
    lo, hi = spec.rope_offset, spec.rope_offset + spec.rotary_dim
    half = (hi - lo) // 2
    per_token = cos.shape[0] > 1
    if not per_token:
        # [1, 1, half, bs]: contiguous over (half, bs), so each op runs over long inner rows.
        c_tab = cos.view(1, 1, half, 1).expand(1, 1, half, bs).contiguous()
        s_tab = sin.view(1, 1, half, 1).expand(1, 1, half, bs).contiguous()
    for p0 in range(0, num_pages, step):
        p1 = min(p0 + step, num_pages)
        np_ = p1 - p0
        pages = kt[p0:p1]
        band = _buffer("band", (np_, nh, hi - lo, bs), torch.float32)
        band.copy_(pages[:, :, lo:hi])
        if per_token:
            t0, t1 = p0 * bs, p1 * bs
            c = _buffer("c", (np_, 1, half, bs), torch.float32)
            s = _buffer("s", (np_, 1, half, bs), torch.float32)
            c.copy_(cos[t0:t1].view(np_, 1, bs, half).transpose(-1, -2))
            s.copy_(sin[t0:t1].view(np_, 1, bs, half).transpose(-1, -2))
        else:
            c, s = c_tab, s_tab
        _rotate_band(band, c, s, spec.style, pages[:, :, lo:hi])


def _rotate_band(band, c, s, style, out):
    """``out = band*c + partner*(+-s)`` along dim -2 (pairs per ``style``), one rounding into ``out``.

    ``band`` fp32 ``[..., R, bs]``; ``c``/``s`` broadcast to ``[..., R/2, bs]``; ``out`` may be
    ``band`` itself (fp32) or a cache-dtype view (rounded on store). Per pair (x1, x2):
    ``x1' = fp32(x1*c) - fp32(x2*s)`` and ``x2' = fp32(x2*c) + fp32(x1*s)``, which is exactly
    ``rotate_fp32``'s ``x*cos + partner*(+-sin)`` (negation is exact).
    """
    half = band.shape[-2] // 2
    if style == "neox":
        x1, x2 = band[..., :half, :], band[..., half:, :]
        o1, o2 = out[..., :half, :], out[..., half:, :]
    else:
        pairs = band.unflatten(-2, (half, 2))
        x1, x2 = pairs[..., 0, :], pairs[..., 1, :]
        opairs = out.unflatten(-2, (half, 2))
        o1, o2 = opairs[..., 0, :], opairs[..., 1, :]
    shape = x1.shape
    a = torch.mul(x1, c, out=_buffer("ta", shape, torch.float32))
    b = torch.mul(x2, s, out=_buffer("tb", shape, torch.float32))
    a.sub_(b)
    b = torch.mul(x2, c, out=b)
    b.add_(torch.mul(x1, s, out=_buffer("td", shape, torch.float32)))
    # Stores last: ``out`` may alias ``band``. fp32 ops with a bf16 ``out=`` take a slow scalar
    # loop, so the rounding happens in ``copy_`` (vectorised), still exactly once.
    o1.copy_(a)
    o2.copy_(b)


def load_cpu_vec(views: CacheViews, cache, slots, k, v, cos, sin, spec, patch_k, patch_v) -> None:
    """CPU_VEC load; ``slots`` may hold padding (-1). Same bytes as ``paged_torch.load_torch``."""
    if load_native(views, cache, slots, k, v, cos, sin, spec, patch_k, patch_v):
        return
    nb, bs, nh, hd = views.k.shape
    has_padding = bool((slots < 0).any())
    if has_padding:
        # Dropped before any arithmetic, as the reference does: a patch product over other rows
        # would be another matmul shape, and BLAS may round another shape differently.
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
        cos, sin = _rows(cos, keep), _rows(sin, keep)
        patch_k, patch_v = _patch_rows(patch_k, keep), _patch_rows(patch_v, keep)
    n = int(k.shape[0])
    if n == 0:
        return
    if patch_k is not None or patch_v is not None:
        # The patch product is one matmul over the whole chunk, exactly the reference's call:
        # split per part (head, slab, tail), multi-threaded BLAS rounds some rows differently.
        k = rotate_and_patch(k, cos, sin, spec, patch_k)
        v = rotate_and_patch(v, None, None, None, patch_v)
        cos = sin = patch_k = patch_v = None
    head, num_pages, blocks = split_blocks(slots, bs)
    slab = slice(head, head + num_pages * bs)
    if blocks is not None:
        _load_slab(views, cache, blocks, k[slab], v[slab], _rows(cos, slab), _rows(sin, slab), spec)
    for part in (slice(0, head), slice(head + num_pages * bs, n)) if blocks is not None else (slice(0, n),):
        if part.stop > part.start:
            _load_generic(views, cache, slots[part], k[part], v[part], _rows(cos, part),
                          _rows(sin, part), spec)


def _rows(t, part):
    return t if t is None or t.shape[0] == 1 else t[part]


def _patch_rows(p, part):
    return None if p is None else (p[0][part], p[1])


def _load_slab(views, cache, blocks, k, v, cos, sin, spec):
    nb, bs, nh, hd = views.k.shape
    num_pages = int(blocks.shape[0])
    page_words = bs * hd * cache.element_size()
    wd = _word_dtype(page_words)
    # [nb, H, 2, page] as words: [:, :, 0] K pages, [:, :, 1] V pages.
    cache_w = cache.view(nb, nh, 2, bs * hd).view(wd)
    b0 = _consecutive(blocks)
    # K: transpose into page layout (bit copy), then recompute in place.
    if b0 is not None:
        kt = cache.view(nb, nh, 2, hd, bs)[b0 : b0 + num_pages, :, 0]
    else:
        kt = _buffer("kt", (num_pages, nh, hd, bs), cache.dtype)
    kt.copy_(k.reshape(num_pages, bs, nh, hd).permute(0, 2, 3, 1))
    if cos is not None:
        _rotate_pages(kt, cos, sin, spec)
    if b0 is None:
        cache_w[:, :, 0].index_copy_(0, blocks, kt.view(num_pages, nh, bs * hd).view(wd))
    # V: rows of D features.
    v_w = v.contiguous().view(num_pages, bs, nh, hd).view(wd).permute(0, 2, 1, 3)  # [P, H, bs, D words]
    dst = cache_w[:, :, 1].unflatten(-1, (bs, -1))
    if b0 is not None:
        dst[b0 : b0 + num_pages].copy_(v_w)
    else:
        dst.index_copy_(0, blocks, v_w)


def _load_generic(views, cache, slots, k, v, cos, sin, spec):
    k = rotate_and_patch(k, cos, sin, spec, None)
    op = vllm_cpu_writer()
    if op is not None:
        nb, bs, nh, hd = views.k.shape
        key_cache, value_cache = cache.view(nb, nh, 2 * bs, hd).chunk(2, dim=2)
        op(k.contiguous(), v.contiguous(), key_cache, value_cache, slots, "vec",
           k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        return
    blocks, offsets = slots // views.block_size, slots % views.block_size
    views.k[blocks, offsets] = k
    views.v[blocks, offsets] = v


def gather_cpu_vec(views: CacheViews, cache, slots) -> tuple[torch.Tensor, torch.Tensor] | None:
    """CPU_VEC gather: the native op for any mapping, else whole-block page reads (None when
    ``slots`` is not block-shaped)."""
    got = gather_native(views, cache, slots)
    if got is not None:
        return got
    nb, bs, nh, hd = views.k.shape
    n = int(slots.shape[0])
    if n == 0 or n % bs or bool((slots < 0).any()):
        return None
    head, num_pages, blocks = split_blocks(slots, bs)
    if blocks is None or head:
        return None
    wd = _word_dtype(bs * hd * cache.element_size())
    pages = cache.view(nb, nh, 2 * bs * hd).view(wd).index_select(0, blocks)
    pages = pages.view(cache.dtype).view(num_pages, nh, 2, bs * hd)
    k = torch.empty(n, nh, hd, dtype=cache.dtype)
    v = torch.empty(n, nh, hd, dtype=cache.dtype)
    k.view(num_pages, bs, nh, hd).copy_(pages[:, :, 0].unflatten(-1, (hd, bs)).permute(0, 3, 1, 2))
    v.view(num_pages, bs, nh, hd).view(wd).copy_(
        pages[:, :, 1].view(wd).unflatten(-1, (bs, -1)).permute(0, 2, 1, 3))
    return k, v
