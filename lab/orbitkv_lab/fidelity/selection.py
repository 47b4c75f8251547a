"""Calibrated and storage arms: VLCache's layer-aware schedule, MM-ShiftKV's decode-aware key
selection and KVCapsule-style compression of the stored chunk KV.

The two storage arms compress the *conditioned* KV ``KV(chunk|A..)`` (the rows the ceiling
holds), i.e. they answer "store each context's exact KV, compressed, at a byte budget"; the patch
answers "store the canonical once plus a rank-m patch". Both are then judged against the ceiling
on the same prompts.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from orbitkv.kernels.relocate import relocate
from orbitkv.kernels.rope import RopeSpec

from . import arms, partial
from .metrics import kl
from .prompts import Item

# ---------------------------------------------------------------- VLCache (§3, greedy schedule)

VLCACHE_GRID = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def vlcache_sensitivity(hm, calib: list[Item], grid=VLCACHE_GRID) -> list[list[float]]:
    """``S[i][g]``: mean KL to the ceiling when only layer ``i`` recomputes the first
    ``grid[g]`` of each reused chunk's tokens and every other layer reuses (VLCache eq. 3)."""
    layers = len(calib[0].ceiling_kv)
    sens = []
    for i in range(layers):
        row = []
        for r in grid:
            ratios = [r if j == i else 0.0 for j in range(layers)]
            row.append(
                sum(
                    kl(it.ceiling_logits, arms.vlcache(hm, it, ratios, "cal").logits)
                    for it in calib
                )
                / len(calib)
            )
        sens.append(row)
    return sens


def vlcache_schedule(sens: list[list[float]], target: float, grid=VLCACHE_GRID) -> list[float]:
    """Greedy: raise one layer a grid step at a time, best sensitivity drop per added ratio,
    keeping ratios non-increasing with depth, until the mean ratio reaches ``target``."""
    layers = len(sens)
    lvl = [0] * layers
    while sum(grid[g] for g in lvl) / layers < target - 1e-12:
        best, best_gain = None, -math.inf
        for i in range(layers):
            g = lvl[i] + 1
            if g >= len(grid) or (i > 0 and g > lvl[i - 1]):
                continue
            gain = (sens[i][lvl[i]] - sens[i][g]) / (grid[g] - grid[lvl[i]])
            if gain > best_gain:
                best, best_gain = i, gain
        if best is None:
            break
        lvl[best] += 1
    return [grid[g] for g in lvl]


# ---------------------------------------------------------------- MM-ShiftKV


@dataclasses.dataclass
class ShiftKVConfig:
    n_proxies: int = 512
    groups: int = 32
    gamma: float = 10.0
    tau: float = 0.95
    lam: float = 1.0
    ref_len: int = 2048  # budgets scale by (reused tokens / ref_len) on tiny prompts


def _query_spec(hm, dq: int) -> RopeSpec:
    s = hm.spec
    return dataclasses.replace(s, head_dim=dq, rope_offset=dq - s.rotary_dim, is_mrope=False)


def shiftkv_drop(
    hm, item: Item, budget: int, cfg: ShiftKVConfig, seed: int = 0
) -> tuple[list[torch.Tensor], float]:
    """Per layer, ``[H_kv, n_prefix]`` bools of the chunk keys MM-ShiftKV evicts at per-head
    budget ``budget``, and the bytes it keeps of the chunk KV."""
    _, _, cap = partial.forward(hm, item.prompt, capture=True)
    rows = item.chunk_rows[: item.n_prefix]
    n = item.n_prefix
    gen = torch.Generator().manual_seed(seed)
    drops, kept_bytes = [], 0.0
    pos = item.prompt.positions[0] if hm.is_mrope else item.prompt.positions
    text = ~item.image_rows  # M-RoPE: only text rows have t = h = w, derotatable by one shift
    future = item.prompt.next_position()
    for li in range(len(item.ceiling_kv)):
        q, k = cap[li]  # [Hq, T, Dq], [Hk, T, Dq]
        hq, _, dq = q.shape
        spec = _query_spec(hm, dq)
        src = q.transpose(0, 1)[text] if hm.is_mrope else q.transpose(0, 1)  # [T', Hq, Dq]
        p = pos[text] if hm.is_mrope else pos
        raw = relocate(src.float().contiguous(), -p.long(), spec)  # queries at position 0
        mu, sd = raw.mean(0), raw.std(0)
        prox = mu + cfg.gamma * sd * torch.randn((cfg.n_proxies, *mu.shape), generator=gen)
        prox = relocate(prox, future, spec)  # synthetic future position
        scores = torch.einsum(
            "phd,htd->hpt", prox, k.repeat_interleave(hq // k.shape[0], 0)[:, :n].float()
        )
        att = torch.softmax(scores * dq**-0.5, -1)[..., rows]  # [Hq, P, n_chunk]
        last = torch.softmax(
            (
                q[:, -1:].float()
                @ k.repeat_interleave(hq // k.shape[0], 0)[:, :n].float().transpose(1, 2)
            )
            * dq**-0.5,
            -1,
        )[:, 0, rows]
        hkv = item.ceiling_kv[li][0].shape[1] if not hm.is_mla else 1
        att = att.reshape(hkv, hq // hkv, cfg.groups, -1, att.shape[-1]).sum(
            dim=(1, 3)
        )  # [Hkv, G, n_c]
        last = last.reshape(hkv, hq // hkv, -1).mean(1)
        order = att.argsort(-1, descending=True)
        cum = torch.gather(att, -1, order).cumsum(-1) / att.sum(-1, keepdim=True)
        inside = torch.zeros_like(att, dtype=torch.bool)
        inside.scatter_(
            -1, order, (cum - torch.gather(att, -1, order) / att.sum(-1, keepdim=True)) < cfg.tau
        )
        score = inside.sum(1).float() + cfg.lam * last  # [Hkv, n_c]
        n_c = score.shape[-1]
        keep = torch.zeros_like(score, dtype=torch.bool)
        keep[:, -1] = True  # the most recent chunk token
        score[:, -1] = -math.inf
        top = score.topk(min(n_c - 1, max(0, budget - 1)), -1).indices
        keep.scatter_(-1, top, True)
        drop = torch.zeros(hkv, n, dtype=torch.bool)
        drop[:, rows] = ~keep
        drops.append(drop)
        kept_bytes += float(keep.sum()) * arms.row_bytes(item.ceiling_kv) / hkv
    return drops, kept_bytes


def shiftkv(hm, item: Item, budget: int, scaled: int, cfg: ShiftKVConfig) -> arms.ArmResult:
    drops, kept = shiftkv_drop(hm, item, scaled, cfg)
    reuse = [item.chunk_rows[: item.n_prefix].clone() for _ in drops]
    return arms._run(
        hm,
        item,
        f"mm-shiftkv@C{budget}",
        "storage",
        item.ceiling_kv,
        reuse,
        drops,
        extra_bytes=kept - arms.chunk_bytes(item),
        stored_bytes=kept,
    )


def shiftkv_budget(item: Item, budget: int, cfg: ShiftKVConfig) -> int:
    return max(2, round(budget * int(item.chunk_rows.sum()) / cfg.ref_len))


# ---------------------------------------------------------------- KVCapsule-style


@dataclasses.dataclass
class Capsule:
    """Per chunk slot and layer: kept token indices + linear reconstructor for the key part, and a
    sequence-axis PCA basis ``U [n, r]`` with mean ``mu [n, 1]`` for the value part."""

    ratio: float
    keys: list[
        list[tuple[torch.Tensor, torch.Tensor]]
    ]  # [slot][layer] (idx [r], M [n, r]), K ~= M K[idx]
    values: list[list[tuple[torch.Tensor, torch.Tensor]]]  # [slot][layer] (U [n, r], mu [n, 1])


def _parts(hm, k: torch.Tensor, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(key-like, value-like) [n, F] of one layer's chunk rows. MLA: rope band / latent ``kv_c``."""
    if hm.is_mla:
        lo = hm.spec.rope_offset
        return k[:, lo:].float(), k[:, :lo].float()
    return k.reshape(k.shape[0], -1).float(), v.reshape(v.shape[0], -1).float()


def _greedy_rows(x: torch.Tensor, r: int) -> torch.Tensor:
    """Pivoted Gram-Schmidt on the rows of ``x`` [n, F]: the ``r`` rows that span it best."""
    res = x.clone()
    picked = []
    for _ in range(r):
        i = int(res.norm(dim=1).argmax())
        picked.append(i)
        b = res[i] / res[i].norm().clamp_min(1e-12)
        res = res - (res @ b)[:, None] * b[None]
    return torch.tensor(sorted(picked))


def _layer_rows(item: Item, li: int, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    s, e = item.chunks[slot]
    k, v = item.ceiling_kv[li]
    return k[s:e], None if v is None else v[s:e]


def fit_capsule(hm, calib: list[Item], ratio: float) -> Capsule:
    """Offline fit on held-out items, per chunk slot (a slot has one fixed length ``n``) and layer:
    a fixed key mask + least-squares reconstructor (KVCapsule's learned mask + MLP, linearised),
    and a sequence-axis value PCA with ``ceil(ratio * n)`` components."""
    keys, values = [], []
    for slot in range(len(calib[0].chunks)):
        keys.append([])
        values.append([])
        for li in range(len(calib[0].ceiling_kv)):
            parts = [_parts(hm, *_layer_rows(it, li, slot)) for it in calib]
            K = torch.cat([p[0] for p in parts], 1)  # [n, F * samples]
            V = torch.cat([p[1] for p in parts], 1)
            r = max(1, math.ceil(ratio * K.shape[0]))
            idx = _greedy_rows(K, r)
            mu = V.mean(1, keepdim=True)
            keys[-1].append((idx, K @ torch.linalg.pinv(K[idx])))
            values[-1].append((torch.linalg.svd(V - mu, full_matrices=False)[0][:, :r], mu))
    return Capsule(ratio, keys, values)


def capsule_kv(hm, item: Item, cap: Capsule) -> tuple[list, float]:
    kv = [[k.clone(), None if v is None else v.clone()] for k, v in item.ceiling_kv]
    stored = 0.0
    for slot, (s, e) in enumerate(item.chunks):
        for li, ((idx, M), (U, mu)) in enumerate(
            zip(cap.keys[slot], cap.values[slot], strict=True)
        ):
            k, v = _layer_rows(item, li, slot)
            kp, vp = _parts(hm, k, v)
            k_hat = M @ kp[idx].to(partial.CACHE_DTYPE).float()
            v_code = (U.T @ (vp - mu)).to(partial.CACHE_DTYPE).float()
            v_hat = U @ v_code + mu
            stored += arms.BYTES * (idx.numel() * kp.shape[1] + v_code.numel())
            if hm.is_mla:
                kv[li][0][s:e] = torch.cat([v_hat, k_hat], 1).to(k.dtype)
            else:
                kv[li][0][s:e] = k_hat.reshape(k.shape).to(k.dtype)
                kv[li][1][s:e] = v_hat.reshape(v.shape).to(v.dtype)
    return [(k, v) for k, v in kv], stored


def capsule(hm, item: Item, cap: Capsule) -> arms.ArmResult:
    kv, stored = capsule_kv(hm, item, cap)
    reuse = [item.chunk_rows[: item.n_prefix].clone() for _ in kv]
    return arms._run(
        hm,
        item,
        f"kvcapsule@{round(cap.ratio * 100)}%",
        "storage",
        kv,
        reuse,
        extra_bytes=stored - arms.chunk_bytes(item),
        stored_bytes=stored,
    )
