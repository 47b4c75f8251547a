"""Triton kernel for ``x + u @ w`` (see ``patch.py`` for the torch reference)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import add_patch

BLOCK_ROWS = 16
BLOCK_COLS = 128
BLOCK_RANK = 32


@triton.jit
def _apply_patch_kernel(
    x_ptr,
    u_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    num_cols,
    rank,
    stride_xn,
    stride_un,
    stride_um,
    stride_wm,
    stride_wf,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col0 = tl.program_id(1) * BLOCK_F
    cols = col0 + tl.arange(0, BLOCK_F)
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (cols < num_cols)[None, :]
    acc = tl.load(x_ptr + rows[:, None] * stride_xn + cols[None, :], mask=mask, other=0.0)
    acc = add_patch(
        acc.to(tl.float32), u_ptr, w_ptr, rows, row_mask, col0, num_cols - col0, rank,
        stride_un, stride_um, stride_wm, stride_wf, BLOCK_F, BLOCK_M,
    )
    tl.store(out_ptr + rows[:, None] * stride_on + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def apply_patch_triton(x: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Launch the kernel: ``x`` ``[N, ...]`` (F trailing features), ``u`` ``[N, m]``, ``w`` ``[m, F]``.

    Arguments are validated by ``patch.apply_patch``; returns a new contiguous tensor like ``x``.
    """
    x2 = x.reshape(x.shape[0], -1).contiguous()
    out = torch.empty_like(x2)
    num_rows, num_cols = x2.shape
    if num_rows and num_cols:
        grid = (triton.cdiv(num_rows, BLOCK_ROWS), triton.cdiv(num_cols, BLOCK_COLS))
        _apply_patch_kernel[grid](
            x2, u, w, out,
            num_rows, num_cols, u.shape[1],
            x2.stride(0), u.stride(0), u.stride(1), w.stride(0), w.stride(1), out.stride(0),
            BLOCK_N=BLOCK_ROWS, BLOCK_F=BLOCK_COLS, BLOCK_M=BLOCK_RANK,
        )
    return out.view(x.shape)
