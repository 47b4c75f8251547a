"""Triton building blocks shared by the relocate, patch and paged-load kernels.

Every helper converts loads to fp32 before any arithmetic: the interpreter (and some GPUs) give
wrong results for arithmetic on bf16 values, and the operator is specified as fp32 compute with
one rounding at the store.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Rotate a whole-row band in registers (``_rotate_tile``); ``check gpu``'s memcpy part also times
# the general path (False) to show what it gains.
IS_ROTATE_IN_REGISTERS = True


def is_full_band(spec, head_dim: int, block_d: int) -> bool:
    """Whether ``spec``'s rotary band is the whole (power-of-two) row: rotated in registers."""
    return (
        IS_ROTATE_IN_REGISTERS and spec.rope_offset == 0
        and spec.rotary_dim == head_dim == block_d
    )


@triton.jit
def load_relocated(
    src_ptr,
    row_off,
    row_mask,
    cos_ptr,
    sin_ptr,
    cs_row,
    stride_cs,
    num_cols,
    stride_col,
    BLOCK_D: tl.constexpr,
    ROT_DIM: tl.constexpr,
    ROPE_OFFSET: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    IS_FULL_BAND: tl.constexpr = False,
    IS_EVEN_D: tl.constexpr = False,
):
    """fp32 tile ``[BLOCK_ROWS, BLOCK_D]`` of rows at ``src_ptr + row_off``, band rotated.

    ``cs_row`` is each row's row in the cos/sin tables (``stride_cs`` 0 for one shared delta).
    ``IS_FULL_BAND``: the band is the whole row (``ROPE_OFFSET`` 0, ``ROT_DIM == BLOCK_D ==
    num_cols``), as in most models; the partner features then come from the loaded tile itself.
    ``IS_EVEN_D``: ``num_cols == BLOCK_D`` (see ``tile_mask``).
    """
    cols = tl.arange(0, BLOCK_D)
    mask = tile_mask(row_mask, cols, num_cols, IS_EVEN_D)
    x = tl.load(src_ptr + row_off[:, None] + cols[None, :] * stride_col, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_ROPE and IS_FULL_BAND:
        x = _rotate_tile(x, cos_ptr, sin_ptr, cs_row, stride_cs, row_mask, ROT_DIM, IS_NEOX)
    elif HAS_ROPE:
        HALF: tl.constexpr = ROT_DIM // 2
        j = cols - ROPE_OFFSET
        in_band = (j >= 0) & (j < ROT_DIM)
        j = tl.where(in_band, j, 0)
        if IS_NEOX:
            is_first = j < HALF
            partner = tl.where(is_first, j + HALF, j - HALF)
            freq = tl.where(is_first, j, j - HALF)
        else:
            is_first = (j % 2) == 0
            partner = tl.where(is_first, j + 1, j - 1)
            freq = j // 2
        band_mask = mask & in_band[None, :]
        x_partner = tl.load(
            src_ptr + row_off[:, None] + (partner + ROPE_OFFSET)[None, :] * stride_col,
            mask=band_mask,
            other=0.0,
        ).to(tl.float32)
        cs_off = cs_row[:, None] * stride_cs + freq[None, :]
        cos = tl.load(cos_ptr + cs_off, mask=band_mask, other=1.0)
        sin = tl.load(sin_ptr + cs_off, mask=band_mask, other=0.0)
        term = x_partner * sin
        rotated = tl.where(is_first[None, :], x * cos - term, x * cos + term)
        # Outside the band the input is kept as loaded, so those features round-trip bit-exactly.
        x = tl.where(in_band[None, :], rotated, x)
    return x


@triton.jit
def tile_mask(row_mask, cols, num_cols, IS_EVEN_D: tl.constexpr):
    """``[rows, BLOCK_D]`` mask of the rows' first ``num_cols`` features. A mask that varies
    along a row with a run-time bound keeps the compiler from vectorising the row's loads and
    stores (one 2-byte access per feature); a full row (``IS_EVEN_D``) is masked by row only."""
    if IS_EVEN_D:
        return tl.broadcast_to(row_mask[:, None], [row_mask.shape[0], cols.shape[0]])
    return row_mask[:, None] & (cols < num_cols)[None, :]


@triton.jit
def _rotate_tile(x, cos_ptr, sin_ptr, cs_row, stride_cs, row_mask, ROT_DIM: tl.constexpr,
                 IS_NEOX: tl.constexpr):
    """``x`` ``[rows, ROT_DIM]`` rotated in registers. The general path loads each feature's
    partner again through a computed index, which the compiler cannot vectorise (one 2-byte load
    per feature, and as many for cos and sin); here every load is a contiguous row."""
    HALF: tl.constexpr = ROT_DIM // 2
    NUM_ROWS: tl.constexpr = x.shape[0]
    if IS_NEOX:
        pairs = tl.permute(tl.reshape(x, [NUM_ROWS, 2, HALF]), [0, 2, 1])
    else:
        pairs = tl.reshape(x, [NUM_ROWS, HALF, 2])
    first, second = tl.split(pairs)
    cs_off = cs_row[:, None] * stride_cs + tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + cs_off, mask=row_mask[:, None], other=1.0)
    sin = tl.load(sin_ptr + cs_off, mask=row_mask[:, None], other=0.0)
    # The same products and sums as the general path, in the same order.
    rotated = tl.join(first * cos - second * sin, second * cos + first * sin)
    if IS_NEOX:
        return tl.reshape(tl.permute(rotated, [0, 2, 1]), [NUM_ROWS, ROT_DIM])
    return tl.reshape(rotated, [NUM_ROWS, ROT_DIM])


@triton.jit
def add_patch(
    acc,
    u_ptr,
    w_ptr,
    rows,
    row_mask,
    col0,
    num_cols,
    rank,
    stride_un,
    stride_um,
    stride_wm,
    stride_wf,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """``acc + u[rows] @ w[:, col0 : col0 + num_cols]`` in fp32 (IEEE, not TF32, products)."""
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < num_cols
    for m0 in range(0, rank, BLOCK_M):
        ms = m0 + tl.arange(0, BLOCK_M)
        m_mask = ms < rank
        u = tl.load(
            u_ptr + rows[:, None] * stride_un + ms[None, :] * stride_um,
            mask=row_mask[:, None] & m_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(
            w_ptr + ms[:, None] * stride_wm + (col0 + cols)[None, :] * stride_wf,
            mask=m_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(u, w, input_precision="ieee")
    return acc
