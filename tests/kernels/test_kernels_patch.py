"""Patch formation (truncated SVD) and application (Triton vs torch)."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import DTYPES, assert_ulp_close
from orbitkv.kernels.patch import apply_patch, apply_patch_ref, form_layer_patch, form_patch


def _fp32_atol(u: torch.Tensor, w: torch.Tensor) -> float:
    # Triton and torch sum the rank dimension in different orders.
    return 8 * torch.finfo(torch.float32).eps * float((u.abs() @ w.abs()).max()) if u.numel() else 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [0, 1, 16, 128])
def test_apply_triton_matches_reference(dtype, rank):
    x = torch.randn(21, 3, 40).to(dtype)
    u, w = torch.randn(21, rank), torch.randn(rank, 120) / 8
    got = apply_patch(x, u, w, backend="triton")
    want = apply_patch_ref(x, u, w)
    assert_ulp_close(got, want, ulps=0 if dtype == torch.float32 else 1, atol=_fp32_atol(u, w))
    assert got.shape == x.shape and got.dtype == x.dtype


def test_apply_rounds_once_from_fp32():
    x = torch.randn(8, 64).bfloat16()
    u, w = torch.randn(8, 4), torch.randn(4, 64)
    want = (x.float() + u @ w).bfloat16()
    assert torch.equal(apply_patch_ref(x, u, w), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_rank_patch_reconstructs(dtype):
    base = torch.randn(24, 2, 16).to(dtype)
    conditioned = (base.float() + 0.3 * torch.randn(24, 2, 16)).to(dtype)
    patch_k, patch_v = form_layer_patch(conditioned, base, rank=24)
    assert patch_v is None and patch_k.rank == 24 and patch_k.energy == pytest.approx(1.0, abs=1e-6)
    for backend in ("torch", "triton"):
        got = apply_patch(base, patch_k.u, patch_k.w, backend=backend)
        # The SVD reconstructs the fp32 deficit to ~1e-6; what remains is the dtype's own rounding.
        assert_ulp_close(got, conditioned, ulps=1, atol=1e-5)


def test_error_monotone_in_rank_and_energy_consistent():
    deficit = torch.randn(40, 64) @ torch.diag(torch.linspace(2.0, 0.01, 64))
    total = float(deficit.double().square().sum())
    errors, energies = [], []
    for rank in range(0, 41, 4):
        f = form_patch(deficit, rank)
        assert f.u.shape == (40, rank) and f.w.shape == (rank, 64)
        assert 0.0 <= f.energy <= 1.0
        residual = float((deficit.double() - f.u.double() @ f.w.double()).square().sum())
        assert f.energy == pytest.approx(1 - residual / total, abs=1e-5)
        errors.append(residual)
        energies.append(f.energy)
    assert all(b <= a * (1 + 1e-6) + 1e-9 for a, b in zip(errors, errors[1:], strict=False))
    assert energies[0] == 0.0 and energies[-1] == pytest.approx(1.0, abs=1e-6)
    assert all(b >= a for a, b in zip(energies, energies[1:], strict=False))


def test_rank_is_clamped_and_zero_deficit_has_full_energy():
    f = form_patch(torch.randn(5, 30), 100)
    assert f.rank == 5 and f.energy == pytest.approx(1.0, abs=1e-6)
    z = form_patch(torch.zeros(6, 8), 3)
    assert z.energy == 1.0 and not z.u.any()


def test_lowrank_path_for_large_deficits():
    """Above the full-SVD size the randomized SVD is used; on an exactly rank-8 deficit it is exact."""
    left, right = torch.randn(1100, 8), torch.randn(8, 1040)
    deficit = left @ right
    f = form_patch(deficit, 16)
    assert f.rank == 16 and f.energy == pytest.approx(1.0, abs=1e-4)
    rel = float((deficit - f.u @ f.w).norm() / deficit.norm())
    assert rel < 1e-4


def test_layer_patch_k_and_v():
    kc, kr = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    vc, vr = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    pk, pv = form_layer_patch(kc, kr, 4, vc, vr)
    assert pk.u.shape == (10, 4) and pk.w.shape == (4, 16) and pv.w.shape == (4, 16)
    assert pk.u.dtype == torch.float32


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: form_patch(torch.randn(3, 4, 5), 2), ValueError, "[N, F]"),
        (lambda: form_patch(torch.ones(3, 4, dtype=torch.int64), 2), TypeError, "floating"),
        (lambda: form_patch(torch.randn(3, 4), -1), ValueError, "rank"),
        (lambda: form_layer_patch(torch.randn(3, 2, 4), torch.randn(3, 2, 5), 1), ValueError, "shape"),
        (lambda: form_layer_patch(torch.randn(3, 4), torch.randn(3, 4), 1, torch.randn(3, 4)),
         ValueError, "both"),
        (lambda: apply_patch(torch.randn(3, 8), torch.randn(3, 2), torch.randn(2, 9)), ValueError, "w [m, F=8]"),
        (lambda: apply_patch(torch.randn(3, 8), torch.randn(4, 2), torch.randn(2, 8)), ValueError, "u [N=3, m]"),
        (lambda: apply_patch(torch.randn(3, 8), torch.randn(3, 2, 1), torch.randn(2, 8)), ValueError, "2-D"),
        (lambda: apply_patch(torch.ones(3, 8, dtype=torch.int32), torch.randn(3, 2), torch.randn(2, 8)),
         TypeError, "dtype"),
    ],
)
def test_bad_input_names_the_problem(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value)
