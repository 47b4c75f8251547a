"""Triton kernels for the fused paged load and its inverse gather (torch reference: ``paged.py``).

Both kernels address the cache through the strided ``[block, token, head, dim]`` views of
``paged_layout.cache_views``, so FLASH (either form), CPU_VEC (K transposed inside a page) and MLA
(one head, no V) differ only in the strides passed. One program handles ``BLOCK_TOKENS`` tokens of
one head, so the patch term is one ``[tokens, m] @ [m, D]`` product per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2
from ._triton_common import add_patch, is_full_band, load_relocated, tile_mask
from .paged_layout import CacheViews
from .rope import RopeSpec

BLOCK_TOKENS = 16
NUM_WARPS = 4
BLOCK_RANK = 32
# The patch loop software-pipelines its ``w`` tiles (``[BLOCK_M, BLOCK_D]`` fp32 per stage). For
# MLA's 576-wide row (BLOCK_D 1024) the default (32 ranks, 3 stages) asks 260 KiB of shared memory,
# over any GPU's limit (an H200 refused it at launch): wide rows take 16 ranks in 2 stages (65 KiB).
WIDE_ROW_D = 512
WIDE_BLOCK_RANK = 16
WIDE_NUM_STAGES = 2


def patch_tiling(block_d: int) -> dict[str, int]:
    """``BLOCK_M`` and ``num_stages`` for a row of ``block_d`` features (see ``WIDE_ROW_D``)."""
    if block_d >= WIDE_ROW_D:
        return {"BLOCK_M": WIDE_BLOCK_RANK, "num_stages": WIDE_NUM_STAGES}
    return {"BLOCK_M": BLOCK_RANK, "num_stages": 3}


@triton.jit
def _load_kernel(
    k_ptr, v_ptr, slot_ptr, cos_ptr, sin_ptr, uk_ptr, wk_ptr, uv_ptr, wv_ptr, kc_ptr, vc_ptr,
    num_tokens, head_dim, block_size, num_slots, rank_k, rank_v,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd, stride_cs,
    stride_ukn, stride_ukm, stride_wkm, stride_wkf, stride_uvn, stride_uvm, stride_wvm, stride_wvf,
    stride_kcb, stride_kcn, stride_kch, stride_kcd, stride_vcb, stride_vcn, stride_vch, stride_vcd,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    ROT_DIM: tl.constexpr, ROPE_OFFSET: tl.constexpr, IS_NEOX: tl.constexpr,
    HAS_ROPE: tl.constexpr, HAS_V: tl.constexpr, HAS_PATCH_K: tl.constexpr,
    HAS_PATCH_V: tl.constexpr, IS_FULL_BAND: tl.constexpr, IS_EVEN_D: tl.constexpr,
):
    head = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_mask = tokens < num_tokens
    slots = tl.load(slot_ptr + tokens, mask=token_mask, other=-1)
    # Padding (-1) and out-of-range slots are dropped here, so no write can leave the cache.
    is_valid = token_mask & (slots >= 0) & (slots < num_slots)
    slots = tl.where(is_valid, slots, 0)
    blocks = slots // block_size
    offsets = slots % block_size
    cols = tl.arange(0, BLOCK_D)
    mask = tile_mask(is_valid, cols, head_dim, IS_EVEN_D)

    x = load_relocated(
        k_ptr, tokens * stride_kt + head * stride_kh, is_valid, cos_ptr, sin_ptr, tokens,
        stride_cs, head_dim, stride_kd, BLOCK_D, ROT_DIM, ROPE_OFFSET, IS_NEOX, HAS_ROPE,
        IS_FULL_BAND, IS_EVEN_D,
    )
    if HAS_PATCH_K:
        x = add_patch(
            x, uk_ptr, wk_ptr, tokens, is_valid, head * head_dim, head_dim, rank_k,
            stride_ukn, stride_ukm, stride_wkm, stride_wkf, BLOCK_D, BLOCK_M,
        )
    dst = blocks * stride_kcb + offsets * stride_kcn + head * stride_kch
    tl.store(kc_ptr + dst[:, None] + cols[None, :] * stride_kcd,
             x.to(kc_ptr.dtype.element_ty), mask=mask)

    if HAS_V:
        y = load_relocated(
            v_ptr, tokens * stride_vt + head * stride_vh, is_valid, cos_ptr, sin_ptr, tokens,
            stride_cs, head_dim, stride_vd, BLOCK_D, ROT_DIM, ROPE_OFFSET, IS_NEOX, False,
            False, IS_EVEN_D,
        )
        if HAS_PATCH_V:
            y = add_patch(
                y, uv_ptr, wv_ptr, tokens, is_valid, head * head_dim, head_dim, rank_v,
                stride_uvn, stride_uvm, stride_wvm, stride_wvf, BLOCK_D, BLOCK_M,
            )
        dst_v = blocks * stride_vcb + offsets * stride_vcn + head * stride_vch
        tl.store(vc_ptr + dst_v[:, None] + cols[None, :] * stride_vcd,
                 y.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_kernel(
    kc_ptr, slot_ptr, out_ptr,
    num_tokens, head_dim, block_size, num_slots,
    stride_kcb, stride_kcn, stride_kch, stride_kcd, stride_ot, stride_oh,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    head = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_mask = tokens < num_tokens
    slots = tl.load(slot_ptr + tokens, mask=token_mask, other=-1)
    is_valid = token_mask & (slots >= 0) & (slots < num_slots)
    slots = tl.where(is_valid, slots, 0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = (cols < head_dim)[None, :]
    src = (slots // block_size) * stride_kcb + (slots % block_size) * stride_kcn + head * stride_kch
    x = tl.load(kc_ptr + src[:, None] + cols[None, :] * stride_kcd,
                mask=is_valid[:, None] & col_mask, other=0.0)
    dst = out_ptr + (tokens * stride_ot + head * stride_oh)[:, None] + cols[None, :]
    tl.store(dst, x, mask=token_mask[:, None] & col_mask)


def load_chunk_triton(
    views: CacheViews,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    spec: RopeSpec | None,
    patch_k: tuple[torch.Tensor, torch.Tensor] | None,
    patch_v: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Launch ``_load_kernel``. ``k``/``v`` ``[N, H, D]`` (MLA ``k`` ``[N, D]``), ``slots`` int64 ``[N]``,
    cos/sin fp32 ``[1 or N, rotary_dim/2]`` or None, patches ``(u [N, m], w [m, H*D])``.

    Arguments are validated by ``paged.load_chunk``.
    """
    k3 = k if k.dim() == 3 else k.unsqueeze(1)
    num_tokens = k3.shape[0]
    if num_tokens == 0:
        return
    has_rope = cos is not None
    if has_rope:
        cos, sin = cos.contiguous(), sin.contiguous()
    else:
        cos = sin = slots  # never read: HAS_ROPE is off
    v3 = v if v is not None else k3
    uk, wk = patch_k if patch_k is not None else (k3, k3)
    uv, wv = patch_v if patch_v is not None else (k3, k3)
    kc = views.k
    vc = views.v if views.v is not None else views.k
    grid = (triton.cdiv(num_tokens, BLOCK_TOKENS), views.num_kv_heads)
    block_d = max(16, next_pow2(views.head_dim))
    _load_kernel[grid](
        k3, v3, slots, cos, sin, uk, wk, uv, wv, kc, vc,
        num_tokens, views.head_dim, views.block_size, views.num_slots,
        uk.shape[1] if patch_k is not None else 0, uv.shape[1] if patch_v is not None else 0,
        k3.stride(0), k3.stride(1), k3.stride(2), v3.stride(0), v3.stride(-2), v3.stride(-1),
        cos.stride(0) if has_rope and cos.shape[0] > 1 else 0,
        uk.stride(0), uk.stride(1), wk.stride(0), wk.stride(1),
        uv.stride(0), uv.stride(1), wv.stride(0), wv.stride(1),
        *kc.stride(), *vc.stride(),
        BLOCK_N=BLOCK_TOKENS, BLOCK_D=block_d, **patch_tiling(block_d),
        ROT_DIM=spec.rotary_dim if has_rope else 2,
        ROPE_OFFSET=spec.rope_offset if has_rope else 0,
        IS_NEOX=(spec.style == "neox") if has_rope else True,
        HAS_ROPE=has_rope, HAS_V=v is not None,
        HAS_PATCH_K=patch_k is not None, HAS_PATCH_V=patch_v is not None,
        IS_FULL_BAND=has_rope and is_full_band(spec, views.head_dim, block_d),
        IS_EVEN_D=views.head_dim == block_d, num_warps=NUM_WARPS,
    )


def gather_chunk_triton(
    views: CacheViews, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch ``_gather_kernel`` for K (and V): returns contiguous ``[N, H, D]`` tensors."""
    num_tokens = slots.shape[0]
    out = []
    for view in (views.k, views.v):
        if view is None:
            out.append(None)
            continue
        dst = view.new_empty(num_tokens, views.num_kv_heads, views.head_dim)
        if num_tokens:
            grid = (triton.cdiv(num_tokens, BLOCK_TOKENS), views.num_kv_heads)
            _gather_kernel[grid](
                view, slots, dst,
                num_tokens, views.head_dim, views.block_size, views.num_slots,
                *view.stride(), dst.stride(0), dst.stride(1),
                BLOCK_N=BLOCK_TOKENS, BLOCK_D=max(16, next_pow2(views.head_dim)),
            )
        out.append(dst)
    return out[0], out[1]
