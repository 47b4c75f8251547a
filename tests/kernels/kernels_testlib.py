"""Helpers for the kernel tests: dtype-derived tolerances and an independent fp64 RoPE."""

from __future__ import annotations

import torch
from orbitkv.kernels.rope import RopeSpec
from orbitkv_bench.checks.numerics import default_inv_freq, make_spec, ulp  # noqa: F401 (re-exported)

DTYPES = [torch.float32, torch.bfloat16]


def assert_ulp_close(actual, expected, *, ulps: float = 1.0, atol: float = 0.0, msg: str = ""):
    """``|actual - expected| <= ulps * ulp(max(|actual|, |expected|)) + atol`` elementwise.

    ``ulps`` is in units of ``expected.dtype``; ``atol`` covers fp32 summation-order differences.
    """
    assert actual.shape == expected.shape, f"{msg} shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{msg} dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.double(), expected.double()
    bound = ulps * ulp(torch.maximum(a.abs(), e.abs()), expected.dtype) + atol
    err = (a - e).abs()
    bad = err > bound
    assert not bool(bad.any()), (
        f"{msg} {int(bad.sum())}/{bad.numel()} elements off; worst err {float(err.max()):.3g}, "
        f"bound there {float(bound.flatten()[int(err.argmax())]):.3g}"
    )


def rope_fp64(x: torch.Tensor, angles: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Apply RoPE from scratch in fp64 with complex multiplication (independent of the kernels).

    ``x`` ``[N, ..., D]`` unrotated; ``angles`` ``[N, rotary_dim/2]`` (radians, fp64).
    """
    x = x.double().clone()
    lo, hi, half = spec.rope_offset, spec.rope_offset + spec.rotary_dim, spec.rotary_dim // 2
    band = x[..., lo:hi]
    if spec.style == "neox":
        z = torch.complex(band[..., :half], band[..., half:])
    else:
        z = torch.view_as_complex(band.reshape(*band.shape[:-1], half, 2).contiguous())
    rot = torch.polar(torch.ones_like(angles), angles)
    while rot.dim() < z.dim():
        rot = rot.unsqueeze(1)
    z = z * rot
    if spec.style == "neox":
        band.copy_(torch.cat([z.real, z.imag], dim=-1))
    else:
        band.copy_(torch.view_as_real(z).flatten(-2))
    return x


def angles_for(positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    return positions.double()[:, None] * torch.tensor(spec.inv_freq, dtype=torch.float64)[None, :]
