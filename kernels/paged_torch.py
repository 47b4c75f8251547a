"""Torch implementation of the paged load/gather: the reference (``backend='torch'``), and the
production CPU path for FLASH/MLA caches (CPU_VEC caches take ``paged_cpu`` under ``auto``).

Writes go through the fastest form the cache allows: whole token rows with ``index_copy_`` when a
token's features are contiguous (FLASH, MLA), whole pages when a CPU_VEC chunk covers full blocks
(K must be transposed there), else advanced-index assignment on the strided K/V views. All forms
store the same values; only the memory traffic differs.
"""

from __future__ import annotations

import torch

from .paged_layout import CacheViews, PagedLayout
from .relocate import rotate_and_patch

Patch = tuple[torch.Tensor, torch.Tensor]


def drop_padding(slots, k, v, cos, sin, patch_k, patch_v):
    """The load's arguments without its padding tokens (negative slots); as given when none."""
    keep = slots >= 0
    if bool(keep.all()):
        return slots, k, v, cos, sin, patch_k, patch_v
    return (
        slots[keep], k[keep], None if v is None else v[keep],
        _select_rows(cos, keep), _select_rows(sin, keep),
        None if patch_k is None else (patch_k[0][keep], patch_k[1]),
        None if patch_v is None else (patch_v[0][keep], patch_v[1]),
    )


def load_torch(views: CacheViews, cache: torch.Tensor, slots, k, v, cos, sin, spec, patch_k, patch_v):
    slots, k, v, cos, sin, patch_k, patch_v = drop_padding(slots, k, v, cos, sin, patch_k, patch_v)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k = rotate_and_patch(k.view(num_tokens, views.num_kv_heads, views.head_dim), cos, sin, spec, patch_k)
    if v is not None:
        v = rotate_and_patch(v, None, None, None, patch_v)
    if _write_pages(views, cache, slots, k, v) or _write_rows(views, cache, slots, k, v):
        return
    blocks, offsets = slots // views.block_size, slots % views.block_size
    views.k[blocks, offsets] = k
    if v is not None:
        views.v[blocks, offsets] = v


def gather_torch(views: CacheViews, cache: torch.Tensor, slots: torch.Tensor):
    keep = slots >= 0
    is_padded = not bool(keep.all())
    safe = torch.where(keep, slots, torch.zeros_like(slots)) if is_padded else slots
    k, v = _read_rows(views, cache, safe)
    if k is None:
        blocks, offsets = safe // views.block_size, safe % views.block_size
        k = views.k[blocks, offsets].contiguous()
        v = None if views.v is None else views.v[blocks, offsets].contiguous()
    if is_padded:
        k[~keep] = 0
        if v is not None:
            v[~keep] = 0
    return k, v


def _select_rows(t: torch.Tensor | None, keep: torch.Tensor) -> torch.Tensor | None:
    return t if t is None or t.shape[0] == 1 else t[keep]


def _row_layout(views: CacheViews, cache: torch.Tensor):
    """``(rows, rows_per_block, v_row_shift, is_kv_interleaved)`` when token rows are contiguous.

    ``rows`` is a 2-D view of the cache whose row ``b * rows_per_block + offset`` holds one token:
    its K (then V at ``+ v_row_shift`` rows), or, interleaved, ``[h0: K V, h1: K V, ...]``.
    """
    nb, bs, nh, hd = views.k.shape
    if views.layout is PagedLayout.MLA:
        if cache.stride() == (bs * hd, hd, 1):
            return cache.view(nb * bs, hd), bs, 0, False
        return None
    if views.layout is not PagedLayout.FLASH:
        return None
    if cache.dim() == 5:
        if cache.is_contiguous():
            return cache.view(nb * 2 * bs, nh * hd), 2 * bs, bs, False
        return None
    width = nh * 2 * hd
    stride_block = cache.stride(0)
    if cache.stride()[1:] == (2 * hd, width, 1) and stride_block % width == 0:
        rows_per_block = stride_block // width
        num_rows = (nb - 1) * rows_per_block + bs
        return cache.as_strided((num_rows, width), (width, 1), cache.storage_offset()), rows_per_block, 0, True
    return None


def _write_rows(views, cache, slots, k, v) -> bool:
    layout = _row_layout(views, cache)
    if layout is None:
        return False
    rows, rows_per_block, v_shift, is_interleaved = layout
    index = (slots // views.block_size) * rows_per_block + slots % views.block_size
    num_tokens = k.shape[0]
    if is_interleaved:
        rows.index_copy_(0, index, torch.cat([k, v], dim=-1).view(num_tokens, -1))
        return True
    rows.index_copy_(0, index, k.reshape(num_tokens, -1))
    if v is not None:
        rows.index_copy_(0, index + v_shift, v.reshape(num_tokens, -1))
    return True


def _read_rows(views, cache, slots):
    layout = _row_layout(views, cache)
    if layout is None:
        return None, None
    rows, rows_per_block, v_shift, is_interleaved = layout
    index = (slots // views.block_size) * rows_per_block + slots % views.block_size
    shape = (slots.shape[0], views.num_kv_heads, views.head_dim)
    if views.layout is PagedLayout.MLA:
        return rows.index_select(0, index).view(shape), None
    if is_interleaved:
        both = rows.index_select(0, index).view(*shape[:2], 2 * views.head_dim)
        return both[..., : views.head_dim].contiguous(), both[..., views.head_dim :].contiguous()
    return rows.index_select(0, index).view(shape), rows.index_select(0, index + v_shift).view(shape)


def _full_blocks(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """Block ids when ``slots`` is a run of whole blocks, each in order; else None."""
    if slots.shape[0] % block_size:
        return None
    per_block = slots.view(-1, block_size)
    blocks = per_block[:, 0] // block_size
    expected = blocks[:, None] * block_size + torch.arange(block_size, device=slots.device)
    return blocks if torch.equal(per_block, expected) else None


def _write_pages(views, cache, slots, k, v) -> bool:
    """CPU_VEC chunk of whole blocks: build each ``(block, head)`` page, K transposed, in one copy."""
    if views.layout is not PagedLayout.CPU_VEC:
        return False
    nb, bs, nh, hd = views.k.shape
    if cache.stride() != (nh * bs * 2 * hd, bs * 2 * hd, 2 * hd, 1):
        return False
    blocks = _full_blocks(slots, bs)
    if blocks is None:
        return False
    num_pages = blocks.shape[0]
    pages = torch.empty(num_pages, nh, 2, bs * hd, dtype=cache.dtype, device=cache.device)
    pages[:, :, 0].unflatten(-1, (hd, bs)).copy_(k.view(num_pages, bs, nh, hd).permute(0, 2, 3, 1))
    pages[:, :, 1].unflatten(-1, (bs, hd)).copy_(v.view(num_pages, bs, nh, hd).permute(0, 2, 1, 3))
    cache.view(nb, -1).index_copy_(0, blocks, pages.view(num_pages, -1))
    return True
