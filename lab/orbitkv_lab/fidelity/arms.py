"""The reuse arms. Every arm starts from the same item (``prompts.Item``) and ends in one partial
forward (``partial.forward``) whose last-token logits are compared with the ceiling.

Byte accounting (all bf16, 2 bytes an element; ``row`` = one token's K+V in one layer):

* patch arms store factors ``u [N, m]`` and ``w [m, F]`` per layer and K/V: ``m (N + F)``
  elements each;
* token-recompute arms store nothing, they recompute; their *byte-equivalent* is the KV rows
  they replace (tokens x layers x row bytes): what storing those rows' conditioned KV would cost.
  That is the matched-bytes comparison of the Kamera paper's Table 6;
* ``stored_bytes`` = canonical chunk KV + extra bytes (storage arms: their compressed size).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from orbitkv.kernels.patch import apply_patch, form_patch

from orbitkv.models import hfrun

from . import partial
from .prompts import Item

BYTES = 2  # bf16 cache and stored factors


@dataclasses.dataclass
class ArmResult:
    name: str
    family: str  # ceiling | reuse | patch | token | storage
    logits: torch.Tensor
    kv: list[hfrun.LayerKV]
    extra_bytes: float = 0.0
    extra_tokens: float = 0.0  # reused tokens recomputed, averaged over layers
    stored_bytes: float | None = None


def row_bytes(kv: list[hfrun.LayerKV]) -> int:
    """Bytes of one token's K+V in one layer."""
    k, v = kv[0]
    return BYTES * (k[0].numel() + (0 if v is None else v[0].numel()))


def chunk_bytes(item: Item) -> float:
    """Canonical bytes of all reused chunks (what the store holds without any repair)."""
    n = int(item.chunk_rows.sum())
    return float(n * row_bytes(item.ceiling_kv) * len(item.ceiling_kv))


def _reuse_all(item: Item, layers: int) -> list[torch.Tensor]:
    rows = item.chunk_rows[: item.n_prefix]
    return [rows.clone() for _ in range(layers)]


def _run(hm, item: Item, name: str, family: str, kv, reuse, drop=None, **kw) -> ArmResult:
    logits, used, _ = partial.forward(hm, item.prompt, kv, reuse, drop)
    res = ArmResult(name, family, logits, hfrun.slice_chunk(used, 0, item.n_prefix), **kw)
    if res.stored_bytes is None:
        res.stored_bytes = chunk_bytes(item) + res.extra_bytes
    return res


def ceiling(hm, item: Item) -> ArmResult:
    return _run(hm, item, "ceiling", "ceiling", None, None)


def blind(hm, item: Item) -> ArmResult:
    return _run(hm, item, "blind", "reuse", item.blind, _reuse_all(item, len(item.blind)))


def relocate_only(hm, item: Item) -> ArmResult:
    return _run(
        hm, item, "relocate", "reuse", item.relocated, _reuse_all(item, len(item.relocated))
    )


# ---------------------------------------------------------------- OrbitKV patch


def deficits(item: Item, chunk: int) -> list[torch.Tensor]:
    """Per layer, [K, V] (MLA: [row]) deficits ``KV(c|A..) - R(delta) KV(c|anchor)``, [N, F] fp32."""
    s, e = item.chunks[chunk]
    out = []
    for (kc, vc), (kr, vr) in zip(item.ceiling_kv, item.relocated, strict=True):
        out.append((kc[s:e].float() - kr[s:e].float()).reshape(e - s, -1))
        if vc is not None:
            out.append((vc[s:e].float() - vr[s:e].float()).reshape(e - s, -1))
    return out


def patch(
    hm, item: Item, rank: int, layers: set[int] | None = None, name: str | None = None
) -> ArmResult:
    kv, nbytes = _patched(item, rank, layers)
    return _run(
        hm,
        item,
        name or f"patch@{rank}",
        "patch",
        kv,
        _reuse_all(item, len(kv)),
        extra_bytes=nbytes,
    )


def _patched(item: Item, rank: int, layers: set[int] | None) -> tuple[list[hfrun.LayerKV], float]:
    kv = [[k.clone(), None if v is None else v.clone()] for k, v in item.relocated]
    nbytes = 0.0
    for c in range(1, len(item.chunks)):
        s, e = item.chunks[c]
        defs = deficits(item, c)
        per = len(defs) // len(kv)
        for li in range(len(kv)):
            if layers is not None and li not in layers:
                continue
            for j in range(per):
                f = form_patch(defs[li * per + j], rank)
                kv[li][j][s:e] = apply_patch(kv[li][j][s:e], f.u, f.w)
                nbytes += BYTES * f.rank * (e - s + f.w.shape[1])
    return [(k, v) for k, v in kv], nbytes


def full_rank(item: Item) -> int:
    return max(e - s for s, e in item.chunks)


# ---------------------------------------------------------------- token recompute


def _token_arm(hm, item: Item, name: str, fresh: list[torch.Tensor]) -> ArmResult:
    """``fresh[l]``: [n_prefix] bools of reused-chunk rows recomputed at layer ``l``."""
    rows = item.chunk_rows[: item.n_prefix]
    reuse = [rows & ~f for f in fresh]
    recomputed = [int((rows & f).sum()) for f in fresh]
    rb = row_bytes(item.ceiling_kv)
    return _run(
        hm,
        item,
        name,
        "token",
        item.relocated,
        reuse,
        extra_bytes=float(sum(recomputed) * rb),
        extra_tokens=sum(recomputed) / len(recomputed),
    )


def cacheblend(hm, item: Item, ratio: float, check_layer: int = 1) -> ArmResult:
    """CacheBlend: layers ``0..check_layer`` recomputed for every token; at the check layer the
    tokens with the largest KV deviation (fresh vs reused, ||dK||^2 + ||dV||^2) are selected,
    top ``ratio`` of the reused tokens, and only they are recomputed in the deeper layers. The
    fresh KV through the check layer is exactly the ceiling's (everything before it is fresh)."""
    rows = item.chunk_rows[: item.n_prefix]
    kc, vc = item.ceiling_kv[check_layer]
    kr, vr = item.relocated[check_layer]
    dev = (kc.float() - kr.float()).reshape(kc.shape[0], -1).square().sum(-1)
    if vc is not None:
        dev = dev + (vc.float() - vr.float()).reshape(vc.shape[0], -1).square().sum(-1)
    dev = dev.masked_fill(~rows, -1.0)
    n_sel = math.ceil(ratio * int(rows.sum()))
    sel = torch.zeros_like(rows)
    sel[torch.topk(dev, n_sel).indices] = True
    sel &= rows
    layers = len(item.ceiling_kv)
    fresh = [rows.clone() if li <= check_layer else sel.clone() for li in range(layers)]
    return _token_arm(hm, item, f"cacheblend@{round(ratio * 100)}%", fresh)


def first_k(item: Item, k_of: callable, include_text: bool) -> torch.Tensor:
    """Rows of the first ``k_of(n)`` tokens of every reused chunk (``n`` its image/chunk tokens),
    plus every text row of the chunks when ``include_text`` (MPIC recomputes all text)."""
    sel = torch.zeros(item.n_prefix, dtype=torch.bool)
    img = item.image_rows[: item.n_prefix]
    for s, e in item.chunks:
        idx = torch.arange(s, e)
        body = idx[img[s:e]] if bool(img[s:e].any()) else idx
        sel[body[: k_of(len(body))]] = True
        if include_text and bool(img[s:e].any()):
            sel[idx[~img[s:e]]] = True
    return sel


def mpic(hm, item: Item, k: int, ref_len: int) -> ArmResult:
    """MPIC-k: all text plus the first k tokens of each image; k scaled by chunk/``ref_len``."""
    sel = first_k(item, lambda n: max(1, round(k * n / ref_len)), include_text=True)
    return _token_arm(hm, item, f"mpic-{k}", [sel] * len(item.ceiling_kv))


def epic(hm, item: Item, k: int, ref_len: int) -> ArmResult:
    """EPIC (LegoLink): the first k tokens of each chunk, at every layer; k scaled likewise."""
    sel = first_k(item, lambda n: max(1, round(k * n / ref_len)), include_text=False)
    return _token_arm(hm, item, f"epic-{k}", [sel] * len(item.ceiling_kv))


def vlcache_fresh(item: Item, ratios: list[float]) -> list[torch.Tensor]:
    """Layer ``l`` recomputes the first ``floor(ratios[l] * T)`` tokens of every reused chunk."""
    return [
        first_k(item, lambda n, r=r: int(math.floor(r * n)), include_text=False)
        if r > 0
        else torch.zeros(item.n_prefix, dtype=torch.bool)
        for r in ratios
    ]


def vlcache(hm, item: Item, ratios: list[float], label: str) -> ArmResult:
    return _token_arm(hm, item, label, vlcache_fresh(item, ratios))
