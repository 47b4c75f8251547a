"""Rank-m conditioning patch: form it from a deficit by truncated SVD, apply it as ``x + u @ w``.

The deficit of a chunk ``B`` read after ``A`` is ``KV(B|A) - R(delta) KV(B|anchor)`` (flattened to
``[N, H*D]`` per layer, for K and V separately). Its leading singular directions carry most of the
cross-chunk conditioning, so a small ``m`` restores most of it.
"""

from __future__ import annotations

import dataclasses

import torch

from ._common import Backend, check_kv_dtype, check_same_device, use_triton

# Above this many singular values a full SVD costs more than a randomized one of the leading few.
_FULL_SVD_MAX_DIM = 1024


@dataclasses.dataclass(frozen=True)
class PatchFactors:
    """``u`` ``[N, m]`` and ``w`` ``[m, F]`` (fp32); ``energy``: captured share of ``||deficit||_F^2``."""

    u: torch.Tensor
    w: torch.Tensor
    energy: float

    @property
    def rank(self) -> int:
        return int(self.u.shape[1])


def form_patch(deficit: torch.Tensor, rank: int, *, niter: int = 4) -> PatchFactors:
    """Best rank-``m`` factors of ``deficit`` ``[N, F]``, ``m = min(rank, N, F)``.

    ``u`` carries the singular values (``u = U_m S_m``, ``w = Vh_m``). A full SVD is used unless both
    sides are large and ``m`` is small, where ``torch.svd_lowrank`` (``niter`` power iterations) is.
    """
    if not isinstance(deficit, torch.Tensor) or not deficit.dtype.is_floating_point:
        raise TypeError("deficit must be a floating-point tensor")
    if deficit.dim() != 2:
        raise ValueError(f"deficit must be [N, F], got shape {tuple(deficit.shape)}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    num_rows, num_cols = deficit.shape
    m = min(rank, num_rows, num_cols)
    d = deficit.float()
    total = float(d.double().square().sum())
    if m == 0 or total == 0.0:
        u = d.new_zeros(num_rows, m)
        w = d.new_zeros(m, num_cols)
        return PatchFactors(u, w, 1.0 if total == 0.0 else 0.0)
    if min(num_rows, num_cols) > _FULL_SVD_MAX_DIM and 4 * m < min(num_rows, num_cols):
        u_full, s, v = torch.svd_lowrank(d, q=min(m + 8, min(num_rows, num_cols)), niter=niter)
        u_m, s_m, vh_m = u_full[:, :m], s[:m], v[:, :m].T
    else:
        u_full, s, vh = torch.linalg.svd(d, full_matrices=False)
        u_m, s_m, vh_m = u_full[:, :m], s[:m], vh[:m]
    captured = float(s_m.double().square().sum())
    energy = min(1.0, max(0.0, captured / total))
    return PatchFactors((u_m * s_m).contiguous(), vh_m.contiguous(), energy)


def form_layer_patch(
    conditioned_k: torch.Tensor,
    relocated_k: torch.Tensor,
    rank: int,
    conditioned_v: torch.Tensor | None = None,
    relocated_v: torch.Tensor | None = None,
) -> tuple[PatchFactors, PatchFactors | None]:
    """K (and V) patches of one layer from ``KV(B|A)`` and the canonical relocated to A's positions.

    Tensors are ``[N, H, D]`` (MLA: ``[N, D]`` rows as ``*_k``, no V). The deficit is taken in fp32.
    """
    patch_k = form_patch(_deficit(conditioned_k, relocated_k, "k"), rank)
    if (conditioned_v is None) != (relocated_v is None):
        raise ValueError("conditioned_v and relocated_v must both be given or both be None")
    if conditioned_v is None:
        return patch_k, None
    return patch_k, form_patch(_deficit(conditioned_v, relocated_v, "v"), rank)


def _deficit(conditioned: torch.Tensor, relocated: torch.Tensor, name: str) -> torch.Tensor:
    if conditioned.shape != relocated.shape:
        raise ValueError(
            f"conditioned_{name} {tuple(conditioned.shape)} and relocated_{name} "
            f"{tuple(relocated.shape)} differ in shape"
        )
    return (conditioned.float() - relocated.float()).reshape(conditioned.shape[0], -1)


def apply_patch(
    x: torch.Tensor, u: torch.Tensor, w: torch.Tensor, *, backend: Backend = "auto"
) -> torch.Tensor:
    """``x + u @ w`` with ``x`` ``[N, ...]`` (trailing dims flatten to F), fp32 accumulate, one rounding."""
    check_patch_args(x, u, w)
    if use_triton(backend, x, u, w):
        from .patch_triton import apply_patch_triton

        return apply_patch_triton(x, u, w)
    return apply_patch_ref(x, u, w)


def apply_patch_ref(x: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    check_patch_args(x, u, w)
    flat = x.reshape(x.shape[0], -1).float() + u.float() @ w.float()
    return flat.to(x.dtype).view(x.shape)


def check_patch_args(x: torch.Tensor, u: torch.Tensor, w: torch.Tensor, name: str = "x") -> None:
    check_kv_dtype(name, x)
    for fname, t in (("u", u), ("w", w)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise TypeError(f"patch factor {fname} must be a floating-point tensor")
        if t.dim() != 2:
            raise ValueError(f"patch factor {fname} must be 2-D, got shape {tuple(t.shape)}")
    num_features = x[0].numel() if x.shape[0] else int(torch.tensor(x.shape[1:]).prod())
    if u.shape[0] != x.shape[0] or w.shape[1] != num_features or u.shape[1] != w.shape[0]:
        raise ValueError(
            f"patch shapes do not fit {name} {tuple(x.shape)}: need u [N={x.shape[0]}, m] and "
            f"w [m, F={num_features}], got u {tuple(u.shape)}, w {tuple(w.shape)}"
        )
    check_same_device(**{name: x, "u": u, "w": w})


def combine_patches(parts: list[PatchFactors], rank: int) -> PatchFactors:
    """The best rank-``rank`` factors of the *mean* of several patches ``mean_i(u_i @ w_i)``.

    The orbit patch (one patch for every ordering of a set of antecedents) is the mean of the
    orderings' patches. The mean is a product of stacked factors, ``[u_1 .. u_n] / n`` times
    ``[w_1; ..; w_n]``, so its truncated SVD comes from two thin QRs and the SVD of a small core,
    never from the ``[N, F]`` deficit. ``energy`` is the share of the mean's ``||.||_F^2`` kept.
    """
    if not parts:
        raise ValueError("combine_patches needs at least one patch")
    u = torch.cat([p.u.float() for p in parts], dim=1) / len(parts)
    w = torch.cat([p.w.float() for p in parts], dim=0)
    q_u, r_u = torch.linalg.qr(u)
    q_w, r_w = torch.linalg.qr(w.T)
    a, s, bh = torch.linalg.svd(r_u @ r_w.T, full_matrices=False)
    m = min(rank, int(s.shape[0]))
    total = float(s.double().square().sum())
    energy = 1.0 if total == 0.0 else float(s[:m].double().square().sum()) / total
    return PatchFactors(
        (q_u @ a[:, :m] * s[:m]).contiguous(), (bh[:m] @ q_w.T).contiguous(), min(1.0, energy)
    )
