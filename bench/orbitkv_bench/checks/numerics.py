"""Units and yardsticks for comparing a kernel with its reference: ULPs of a cache dtype, the
operands' magnitude they are measured against, and the tolerance a dtype allows.

Shared by ``orbitkv check gpu`` and the kernel tests (``tests/kernels/kernels_testlib.py``).
"""

from __future__ import annotations

import torch
from orbitkv.kernels.rope import RopeSpec

# fp32 arithmetic the kernels and the references may order differently: FMA contraction on a GPU,
# the patch product's summation order (tl.dot vs BLAS). A few fp32 ULPs of the operands' magnitude
# each; 16 is the allowance the kernel tests have used since the kernels were written.
FP32_NOISE_ULPS = 16.0


def ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each ``|magnitude|`` (fp64)."""
    fi = torch.finfo(dtype)
    mag = magnitude.double().abs().clamp_min(fi.smallest_normal)
    _, exponent = torch.frexp(mag)
    return torch.ldexp(torch.full_like(mag, fi.eps), exponent - 1)


def tolerance_ulps(dtype: torch.dtype) -> float:
    """What a kernel may differ from its reference by, in ULPs of ``dtype`` at the operands' magnitude.

    Both compute in fp32 and round once to ``dtype``: one ULP where the two fp32 values fall on
    either side of a rounding boundary (none for fp32 itself), plus the fp32 noise of
    ``FP32_NOISE_ULPS`` fp32 ULPs expressed in ULPs of ``dtype``.
    """
    rounding = 0.0 if dtype == torch.float32 else 1.0
    eps32, eps = torch.finfo(torch.float32).eps, torch.finfo(dtype).eps
    return rounding + FP32_NOISE_ULPS * eps32 / eps


def default_inv_freq(rotary_dim: int, base: float = 10000.0) -> tuple[float, ...]:
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return tuple(float(x) for x in 1.0 / base**exps)


def make_spec(style: str, head_dim: int, rotary_dim: int, rope_offset: int = 0, **kw) -> RopeSpec:
    """A ``RopeSpec`` with the usual ``10000^(-2i/rotary_dim)`` frequencies."""
    return RopeSpec(style, head_dim, rotary_dim, default_inv_freq(rotary_dim), rope_offset, **kw)


def pair_radius(x: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """``|x|`` (fp64) with each rotated feature replaced by its pair's radius ``hypot(x_i, x_j)``.

    A rotation mixes the two features of a pair, so its error scales with the radius, not with
    either feature (one of them may be near zero after the rotation).
    """
    mag = x.double().abs()
    lo, half = spec.rope_offset, spec.rotary_dim // 2
    idx = torch.arange(half, device=x.device)
    first = lo + (idx if spec.style == "neox" else 2 * idx)
    second = first + (half if spec.style == "neox" else 1)
    radius = torch.hypot(mag[..., first], mag[..., second])
    mag[..., first] = radius
    mag[..., second] = radius
    return mag


def patch_magnitude(u: torch.Tensor, w: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``|u| @ |w|`` (fp64) viewed as ``shape``: the magnitude of the patch term's products."""
    return (u.double().abs() @ w.double().abs()).view(shape)


def ulp_stats(
    actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor
) -> tuple[float, float]:
    """Max and mean of ``|actual - expected|`` in ULPs of ``expected.dtype`` at
    ``max(|actual|, |expected|, magnitude)``; ``magnitude`` is the operands' (``pair_radius``,
    plus ``patch_magnitude`` where a patch is added). ``(0, 0)`` for empty tensors."""
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if expected.numel() == 0:
        return 0.0, 0.0
    a, e = actual.double().cpu(), expected.double().cpu()
    scale = torch.maximum(torch.maximum(a.abs(), e.abs()), magnitude.double().cpu())
    err = (a - e).abs() / ulp(scale, expected.dtype)
    return float(err.max()), float(err.mean())
