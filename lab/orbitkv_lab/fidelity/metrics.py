"""Fidelity measures: next-token KL to the ceiling, eta, flips, KV error by layer, deficit energy."""

from __future__ import annotations

import math

import torch


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(ceiling || arm) of the next-token distributions, nats."""
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


def eta(kl_arm: float, kl_base: float) -> float:
    """Fraction of the base->ceiling KL gap the arm closes (1: ceiling, 0: no better than base)."""
    return 1.0 - kl_arm / kl_base if kl_base > 0 else float("nan")


def kv_rel_err(kv, ref, rows: torch.Tensor) -> list[float]:
    """Per layer ``||KV - KV_ceiling|| / ||KV_ceiling||`` over the reused chunk rows (K and V)."""
    out = []
    for (k, v), (kr, vr) in zip(kv, ref, strict=True):
        num = (k[rows].float() - kr[rows].float()).square().sum()
        den = kr[rows].float().square().sum()
        if v is not None:
            num = num + (v[rows].float() - vr[rows].float()).square().sum()
            den = den + vr[rows].float().square().sum()
        out.append(math.sqrt(float(num) / max(float(den), 1e-30)))
    return out


def energy_by_rank(deficits: list[torch.Tensor], ranks: list[int]) -> dict[str, float]:
    """Share of ``sum ||deficit||_F^2`` the best rank-m factors capture, pooled over matrices."""
    svs = [torch.linalg.svdvals(d.double()).square() for d in deficits]
    total = sum(float(s.sum()) for s in svs)
    return {str(m): (sum(float(s[:m].sum()) for s in svs) / total if total else 1.0) for m in ranks}


def flips(
    ceiling_ans: list[int], base_ans: list[int], arm_ans: list[int]
) -> dict[str, float | int]:
    """Items where the base arm changes the ceiling's argmax, and the share the arm restores."""
    flipped = [i for i, (c, b) in enumerate(zip(ceiling_ans, base_ans, strict=True)) if c != b]
    rec = sum(1 for i in flipped if arm_ans[i] == ceiling_ans[i])
    return {
        "n_flipped": len(flipped),
        "flip_rate": len(flipped) / max(1, len(ceiling_ans)),
        "recovered": rec,
        "flip_recover": rec / len(flipped) if flipped else float("nan"),
        "agree": sum(1 for c, a in zip(ceiling_ans, arm_ans, strict=True) if c == a)
        / max(1, len(ceiling_ans)),
    }
