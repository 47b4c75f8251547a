"""Relocation: rotate stored post-RoPE keys by ``delta`` positions, exactly.

A key cached at position ``p`` is ``R(p) k``; the same key at ``p + delta`` is ``R(delta) R(p) k``,
so moving a chunk is one more rotation of its stored keys. The rotation runs in fp32 from fp32
cos/sin of an fp64 angle (``RopeSpec.cos_sin``) and is rounded once to the key dtype; features
outside the rotated band are copied bit for bit.
"""

from __future__ import annotations

import torch

from ._common import Backend, check_kv_dtype, use_triton
from .rope import RopeSpec


def relocate(
    k: torch.Tensor, delta: int | torch.Tensor, spec: RopeSpec, *, backend: Backend = "auto"
) -> torch.Tensor:
    """Keys ``k`` (``[N, H, D]``, or ``[N, D]`` for MLA rows) moved by ``delta`` positions.

    ``delta`` is an int or an integer tensor ``[N]`` (one shift per token; M-RoPE position units
    for M-RoPE models). Out of place; same dtype and shape as ``k``. ``backend='triton'`` forces
    the Triton kernel (CPU tensors need ``TRITON_INTERPRET=1``).
    """
    cos, sin = rope_tables(k, delta, spec)
    if use_triton(backend, k):
        from .relocate_triton import relocate_triton

        return relocate_triton(k, cos, sin, spec)
    return _relocate_torch(k, cos, sin, spec)


def relocate_ref(k: torch.Tensor, delta: int | torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Pure-torch relocation, the reference the Triton kernel is tested against."""
    cos, sin = rope_tables(k, delta, spec)
    return _relocate_torch(k, cos, sin, spec)


def rope_tables(
    k: torch.Tensor, delta: int | torch.Tensor, spec: RopeSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``(k, delta, spec)`` and return fp32 cos/sin ``[1 or N, rotary_dim/2]`` on k's device."""
    check_kv_dtype("k", k)
    check_spec(spec, k.shape[-1], "k")
    if k.dim() not in (2, 3):
        raise ValueError(f"k must be [N, H, D] or [N, D] (MLA), got shape {tuple(k.shape)}")
    delta = check_delta(delta, k.shape[0])
    return spec.cos_sin(delta, device=k.device)


def check_spec(spec: RopeSpec | None, head_dim: int, what: str) -> None:
    if not isinstance(spec, RopeSpec):
        raise TypeError(f"spec must be a RopeSpec, got {type(spec).__name__}")
    if spec.head_dim != head_dim:
        raise ValueError(
            f"RopeSpec.head_dim={spec.head_dim} does not match the last dim of {what} ({head_dim})"
        )


def check_delta(delta: int | torch.Tensor, num_tokens: int) -> int | torch.Tensor:
    """An int, or an integer tensor with one entry per token (a 0-d / 1-element tensor is a scalar)."""
    if isinstance(delta, bool):
        raise TypeError("delta must be an int or an integer tensor, got bool")
    if isinstance(delta, int):
        return delta
    if not isinstance(delta, torch.Tensor):
        raise TypeError(f"delta must be an int or an integer tensor, got {type(delta).__name__}")
    if delta.dtype.is_floating_point or delta.dtype.is_complex or delta.dtype == torch.bool:
        raise TypeError(f"delta must be an integer tensor (int64), got dtype {delta.dtype}")
    if delta.dim() == 0:
        return int(delta)
    if delta.dim() != 1 or delta.shape[0] != num_tokens:
        raise ValueError(
            f"delta tensor must have shape [N]=[{num_tokens}] (one shift per token), "
            f"got {tuple(delta.shape)}"
        )
    return delta


def is_zero_delta(delta: int | torch.Tensor) -> bool:
    return isinstance(delta, int) and delta == 0


def rotate_fp32(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec
) -> torch.Tensor:
    """Rotate the band of fp32 rows ``x`` (``[N, H, D]`` or ``[N, D]``) in place and return it.

    ``cos``/``sin`` are ``[1 or N, rotary_dim/2]``. Computed as ``x*cos + partner*(+-sin)``: the same
    two rounded products and one rounded sum per feature as the Triton kernel, with few passes
    over memory (this is the production CPU path).
    """
    lo, hi, half = spec.rope_offset, spec.rope_offset + spec.rotary_dim, spec.rotary_dim // 2
    band = x[..., lo:hi]
    if spec.style == "neox":
        partner = band.roll(half, dims=-1)
        cos_full = torch.cat([cos, cos], dim=-1)
        sin_signed = torch.cat([-sin, sin], dim=-1)
    else:
        partner = band.unflatten(-1, (half, 2)).flip(-1).flatten(-2)
        cos_full = cos.repeat_interleave(2, dim=-1)
        sin_signed = torch.stack([-sin, sin], dim=-1).flatten(-2)
    if x.dim() == 3:
        cos_full, sin_signed = cos_full[:, None, :], sin_signed[:, None, :]
    partner *= sin_signed
    band *= cos_full
    band += partner
    return x


# fp32 working set per step of ``rotate_and_patch``: small enough to stay in cache and be served from the
# allocator's free lists. One pass over a whole long chunk allocates multi-MB temporaries, and
# their page faults cost more than the arithmetic (about 3x slower at 4096 tokens).
_STEP_ELEMS = 1 << 16


def rotate_and_patch(
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    spec: RopeSpec | None,
    patch: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """``round(R x + u @ w)`` from fp32, rounded once; ``x`` itself when there is nothing to do.

    ``x`` ``[N, ...]`` rows (the band per ``spec``; features outside it round-trip exactly), cos/sin
    ``[1 or N, rotary_dim/2]`` or None, ``patch`` ``(u [N, m], w [m, F])`` or None. The patch
    product is one matmul (``patch_product``); the rest works in token steps (see ``_STEP_ELEMS``).
    The torch path of both ``relocate`` and ``paged.load_chunk``.
    """
    if cos is None and patch is None:
        return x
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    prod = None if patch is None else patch_product(*patch)
    for rows in token_steps(x):
        acc = x[rows].to(torch.float32, copy=True)
        if cos is not None:
            per_token = cos.shape[0] > 1
            rotate_fp32(acc, cos[rows] if per_token else cos, sin[rows] if per_token else sin, spec)
        if prod is not None:
            acc.view(acc.shape[0], -1).add_(prod[rows])
        out[rows] = acc
    return out


def token_steps(x: torch.Tensor) -> list[slice]:
    """The row steps of ``rotate_and_patch`` over ``x`` ``[N, ...]`` (see ``_STEP_ELEMS``)."""
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return []
    step = max(1, _STEP_ELEMS // max(1, x[0].numel()))
    return [slice(s, min(s + step, num_tokens)) for s in range(0, num_tokens, step)]


def patch_product(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The patch product ``u @ w`` in fp32 ``[N, F]``: one BLAS call over the whole chunk.

    Every path adds exactly this tensor: under several threads BLAS may round a matmul over a
    subset of the rows differently, so no path may split it. Its cost (2m flops per element) is
    what bounds a patched load on the CPU, not the memory traffic.
    """
    return u.float() @ w.float()


def _relocate_torch(
    k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec
) -> torch.Tensor:
    return rotate_and_patch(k, cos, sin, spec, None)
