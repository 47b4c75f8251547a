"""Triton relocation kernel (see ``relocate.py`` for the maths and the torch reference)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2
from ._triton_common import is_full_band, load_relocated, tile_mask
from .rope import RopeSpec

BLOCK_TOKENS = 16


@triton.jit
def _relocate_kernel(
    k_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    num_tokens,
    head_dim,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_ot,
    stride_oh,
    stride_cs,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROT_DIM: tl.constexpr,
    ROPE_OFFSET: tl.constexpr,
    IS_NEOX: tl.constexpr,
    IS_FULL_BAND: tl.constexpr,
    IS_EVEN_D: tl.constexpr,
):
    # One program: BLOCK_N tokens of one head.
    head = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_mask = tokens < num_tokens
    x = load_relocated(
        k_ptr, tokens * stride_kt + head * stride_kh, token_mask, cos_ptr, sin_ptr, tokens,
        stride_cs, head_dim, stride_kd, BLOCK_D, ROT_DIM, ROPE_OFFSET, IS_NEOX, True,
        IS_FULL_BAND, IS_EVEN_D,
    )
    cols = tl.arange(0, BLOCK_D)
    mask = tile_mask(token_mask, cols, head_dim, IS_EVEN_D)
    out = out_ptr + (tokens * stride_ot + head * stride_oh)[:, None] + cols[None, :]
    tl.store(out, x.to(out_ptr.dtype.element_ty), mask=mask)


def relocate_triton(
    k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec
) -> torch.Tensor:
    """Launch the kernel. ``k`` ``[N, H, D]`` or ``[N, D]``; cos/sin fp32 ``[1 or N, rotary_dim/2]``.

    Returns a new contiguous tensor shaped like ``k``. Arguments are validated by ``relocate``.
    """
    if cos.shape != sin.shape or cos.shape[0] not in (1, k.shape[0]):
        raise ValueError(f"cos/sin must be [1 or N, rotary_dim/2], got {tuple(cos.shape)}")
    k3 = k if k.dim() == 3 else k.unsqueeze(1)
    num_tokens, num_heads, head_dim = k3.shape
    out = torch.empty_like(k3, memory_format=torch.contiguous_format)
    cos, sin = cos.contiguous(), sin.contiguous()
    stride_cs = 0 if cos.shape[0] == 1 else cos.stride(0)
    grid = (triton.cdiv(num_tokens, BLOCK_TOKENS), num_heads)
    block_d = max(16, next_pow2(head_dim))
    if num_tokens:
        _relocate_kernel[grid](
            k3, out, cos, sin,
            num_tokens, head_dim,
            k3.stride(0), k3.stride(1), k3.stride(2), out.stride(0), out.stride(1), stride_cs,
            BLOCK_N=BLOCK_TOKENS, BLOCK_D=block_d, ROT_DIM=spec.rotary_dim,
            ROPE_OFFSET=spec.rope_offset, IS_NEOX=spec.style == "neox",
            IS_FULL_BAND=is_full_band(spec, head_dim, block_d), IS_EVEN_D=head_dim == block_d,
        )
    return out.view(k.shape)
