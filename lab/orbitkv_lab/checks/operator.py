"""``orbitkv check operator [--json] [--arch A ...]``: is relocate + patch exact on real models?

For every arch of ``make_model`` (random weights, transformers, fp32 model with the cache rounded
to bf16 as a bf16 vLLM cache would hold it):

relocation
    One prompt runs at positions ``p..p+n`` and again at ``p+delta..`` (explicit position ids;
    M-RoPE shifts t/h/w alike; the VLMs carry an image). The first run's bf16 keys relocated by
    ``delta`` must equal the second run's bf16 keys within ``MAX_ULP`` bf16 ULP, both ways. Values
    must be equal (up to a rounding flip from fp32 noise in deeper layers). The next token read
    against the relocated cache must give the shifted run's distribution (KL <= ``MAX_KL``).
    ``relocate_fp32_max_ulp`` repeats the comparison on the fp32 keys, rotated band only, before
    any cache rounding: what is left there is the relocation's own error plus fp32 noise.

patch
    Chunk B after A (``[A . B]``) vs B after the anchor (``[BOS . B]``): the canonical relocated to
    B's place plus the full-rank patch must rebuild ``KV(B|A)`` within ``MAX_ULP``, and the error
    left by a rank-m patch must fall as m grows.

ULP unit: a rotation mixes each rotated feature with its pair partner, so a rotated feature's error
is measured in ULPs of its pair's radius ``sqrt(x_i^2 + x_j^2)``, every other feature in ULPs of its
own magnitude; a magnitude below ``2^-8`` of its head row's RMS counts as that floor. Without the
floor a feature 1000x smaller than its neighbours would be judged on fp32 noise of the SVD (tens of
"ULPs" that no dot product with that row can see).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from orbitkv.kernels.patch import apply_patch, form_patch
from orbitkv.kernels.relocate import relocate
from orbitkv.kernels.rope import RopeSpec

from orbitkv.models import hfrun
from orbitkv.models.make_model import ARCHES, ensure_models

MAX_ULP = 2.0
ULP_FLOOR = 2.0**-8
MAX_VALUE_ULP = 1.0
MAX_KL = 1e-4
START = 5
DELTA = 517  # odd and large, so a slip of one position or a wrong frequency shows
RANKS = (1, 2, 4, 8)
CACHE_DTYPE = torch.bfloat16

TEXT_A = "User: hello there! Compare the two images and answer briefly."
TEXT_B = "Rotary position embeddings rotate pairs of features by an angle."


def bf16_ulp(mag: torch.Tensor) -> torch.Tensor:
    """bf16 ULP at magnitude ``mag``: 2^(e-8) for ``mag`` in [2^(e-1), 2^e) (8 significant bits)."""
    _, exp = torch.frexp(mag.float().abs().clamp_min(2.0**-126))
    return torch.ldexp(torch.ones_like(mag, dtype=torch.float32), exp - 8)


def feature_magnitude(x: torch.Tensor, spec: RopeSpec | None) -> torch.Tensor:
    """|x|, rotated features replaced by the radius of their rotation pair, floored at
    ``ULP_FLOOR`` times the RMS of the row (last dim) they sit in."""
    x = x.float()
    mag = x.abs()
    if spec is not None:
        lo, half = spec.rope_offset, spec.rotary_dim // 2
        idx = torch.arange(half)
        first = lo + (idx if spec.style == "neox" else 2 * idx)
        second = first + (half if spec.style == "neox" else 1)
        radius = torch.hypot(x[..., first], x[..., second])
        mag[..., first] = radius
        mag[..., second] = radius
    floor = ULP_FLOOR * x.square().mean(-1, keepdim=True).sqrt()
    return torch.maximum(mag, floor)


def ulp_error(out: torch.Tensor, ref: torch.Tensor, spec: RopeSpec | None) -> torch.Tensor:
    return (out.float() - ref.float()).abs() / bf16_ulp(feature_magnitude(ref, spec))


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(ref || other) of the next-token distributions, in nats."""
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


def _round(kv: list[hfrun.LayerKV]) -> list[hfrun.LayerKV]:
    return [(k.to(CACHE_DTYPE), None if v is None else v.to(CACHE_DTYPE)) for k, v in kv]


def _image(seed: int) -> Any:
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(64, 64, 3) * 255).astype("uint8"))


def _chunk_b(hm: hfrun.HFModel) -> Any:
    return _image(1) if hm.image_processor is not None else TEXT_B


def check_relocation(
    hm: hfrun.HFModel, *, spec: RopeSpec | None = None, delta: int = DELTA, delta_error: int = 0
) -> dict[str, Any]:
    """Relocation exactness. ``spec``/``delta_error`` inject a wrong spec or shift (to show the
    check can fail): the relocation uses them, the reference run the true ``delta``."""
    spec = spec or hm.spec
    prompt = hfrun.build_prompt(hm, [TEXT_A, _chunk_b(hm), "Answer:"])
    _, kv1 = hfrun.run(hm, prompt, START)
    _, kv2 = hfrun.run(hm, prompt, START + delta)
    b1, b2 = _round(kv1), _round(kv2)
    k_errs, v_errs, fp32_errs, relocated = [], [], [], []
    for (k1, v1), (k2, v2), (k1f, _), (k2f, _) in zip(b1, b2, kv1, kv2, strict=True):
        moved = relocate(k1, delta + delta_error, spec)
        relocated.append((moved, v1))
        k_errs += [ulp_error(moved, k2, hm.spec), ulp_error(relocate(k2, -delta - delta_error, spec), k1, hm.spec)]
        band = slice(hm.spec.rope_offset, hm.spec.rope_offset + hm.spec.rotary_dim)
        fp32_errs.append(ulp_error(relocate(k1f, delta + delta_error, spec), k2f, hm.spec)[..., band])
        if v1 is not None:
            v_errs.append(ulp_error(v1, v2, None))
    k_all = torch.cat([e.flatten() for e in k_errs])
    token = hm.tokenizer.eos_token_id
    pos = prompt.next_position() + START + delta
    ref = hfrun.next_logits(hm, b2, token, pos)
    row = {
        "tokens": len(prompt),
        "delta": delta,
        "relocate_max_ulp": float(k_all.max()),
        "relocate_mean_ulp": float(k_all.mean()),
        "relocate_fp32_max_ulp": float(torch.cat([e.flatten() for e in fp32_errs]).max()),
        "kl_relocated": kl(ref, hfrun.next_logits(hm, relocated, token, pos)),
        "kl_unrelocated": kl(ref, hfrun.next_logits(hm, b1, token, pos)),
    }
    if v_errs:
        v_all = torch.cat([e.flatten() for e in v_errs])
        row["values_max_ulp"] = float(v_all.max())
        row["values_identical_frac"] = float((v_all == 0).double().mean())
        # Layer 0 sees no attention output yet, so its values cannot differ at all.
        row["values_layer0_identical"] = bool(torch.equal(b1[0][1], b2[0][1]))
    return row


def _b_delta(hm: hfrun.HFModel, ab: hfrun.Prompt, xb: hfrun.Prompt) -> int:
    """B's uniform shift from ``[anchor . B]`` to ``[A . B]`` (M-RoPE units for M-RoPE)."""
    (sa, ea), (sx, ex) = ab.spans[-1], xb.spans[-1]
    shift = ab.positions[..., sa:ea] - xb.positions[..., sx:ex]
    if not bool((shift == shift.flatten()[0]).all()):
        raise AssertionError("chunk B does not move uniformly between the two prompts")
    return int(shift.flatten()[0])


def check_patch(hm: hfrun.HFModel, ranks: tuple[int, ...] = RANKS) -> dict[str, Any]:
    chunk_b = _chunk_b(hm)
    ab = hfrun.build_prompt(hm, [TEXT_A, chunk_b])
    xb = hfrun.build_prompt(hm, [chunk_b])
    delta = _b_delta(hm, ab, xb)
    _, kv_ab = hfrun.run(hm, ab)
    _, kv_xb = hfrun.run(hm, xb)
    start = ab.spans[-1][0]
    cond = hfrun.slice_chunk(kv_ab, *ab.spans[-1])
    canon = _round(hfrun.slice_chunk(kv_xb, *xb.spans[-1]))
    # Per layer, the stored canonical relocated to B's place and the deficits it leaves (fp32).
    parts = []
    for (kc, vc), (ks, vs) in zip(cond, canon, strict=True):
        moved = relocate(ks, delta, hm.spec)
        parts.append(("k", kc, moved, hm.spec))
        if vc is not None:
            parts.append(("v", vc, vs, None))
    deficits = [(c.float() - m.float()).reshape(c.shape[0], -1) for _, c, m, _ in parts]
    total = sum(float(d.double().square().sum()) for d in deficits)
    full = max(min(d.shape) for d in deficits)
    rel_err: dict[str, float] = {}
    energy: dict[str, float] = {}
    for m in (*ranks, full):
        factors = [form_patch(d, m) for d in deficits]
        left = sum(float((d - f.u @ f.w).double().square().sum()) for d, f in zip(deficits, factors, strict=True))
        rel_err[str(m)] = math.sqrt(left / total) if total else 0.0
        energy[str(m)] = 1.0 - left / total if total else 1.0
    factors = [form_patch(d, full) for d in deficits]
    ulps, blind, patched = [], [], []
    for (_, c, moved, spec), f in zip(parts, factors, strict=True):
        rebuilt = apply_patch(moved, f.u, f.w)
        ulps.append(ulp_error(rebuilt, c.to(CACHE_DTYPE), spec).flatten())
        blind.append(moved)
        patched.append(rebuilt)
    prefix = _round(hfrun.slice_chunk(kv_ab, 0, start))
    token = hm.tokenizer.eos_token_id
    pos = ab.next_position()
    ref = hfrun.next_logits(hm, _round(kv_ab), token, pos)
    errs = list(rel_err.values())
    return {
        "patch_tokens": ab.spans[-1][1] - start,
        "patch_delta": delta,
        "deficit_rel_norm": math.sqrt(total) / _norm([c for _, c, _, _ in parts]),
        "patch_full_rank": full,
        "patch_full_rank_max_ulp": float(torch.cat(ulps).max()),
        "patch_rel_err_by_rank": rel_err,
        "patch_energy_by_rank": energy,
        "patch_monotone": all(b <= a + 1e-6 for a, b in zip(errs, errs[1:], strict=False)),
        "kl_blind": kl(ref, hfrun.next_logits(hm, hfrun.cat_chunks(prefix, _pair(hm, blind)), token, pos)),
        "kl_patched_full": kl(ref, hfrun.next_logits(hm, hfrun.cat_chunks(prefix, _pair(hm, patched)), token, pos)),
    }


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def _pair(hm: hfrun.HFModel, flat: list[torch.Tensor]) -> list[hfrun.LayerKV]:
    """Regroup a per-layer [k, v, k, v, ...] list (MLA: [kv, kv, ...]) into chunk layers."""
    if hm.is_mla:
        return [(t, None) for t in flat]
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


def judge(row: dict[str, Any]) -> list[str]:
    """Names of the thresholds a row misses (empty: the arch passes)."""
    fails = []
    if not row["relocate_max_ulp"] <= MAX_ULP:
        fails.append(f"relocate_max_ulp > {MAX_ULP}")
    if not row.get("values_max_ulp", 0.0) <= MAX_VALUE_ULP:
        fails.append(f"values_max_ulp > {MAX_VALUE_ULP}")
    if not row.get("values_layer0_identical", True):
        fails.append("layer-0 values differ")
    if not row["kl_relocated"] <= MAX_KL:
        fails.append(f"kl_relocated > {MAX_KL}")
    if not row["patch_full_rank_max_ulp"] <= MAX_ULP:
        fails.append(f"patch_full_rank_max_ulp > {MAX_ULP}")
    if not row["patch_monotone"]:
        fails.append("patch error not monotone in rank")
    return fails


def check_arch(arch: str, models_dir: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    hm = hfrun.load(ensure_models(models_dir, (arch,))[arch])
    row: dict[str, Any] = {"arch": arch, "rope": _describe(hm.spec)}
    row.update(check_relocation(hm))
    row.update(check_patch(hm))
    row["failures"] = judge(row)
    row["ok"] = not row["failures"]
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def _describe(spec: RopeSpec) -> str:
    kind = "mrope" if spec.is_mrope else spec.style
    return f"{kind} rotary {spec.rotary_dim}/{spec.head_dim} at {spec.rope_offset}"


def run_checks(arches: tuple[str, ...] = ARCHES, models_dir: str | Path | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="orbitkv-models-") as tmp:
        root = Path(models_dir) if models_dir else Path(tmp)
        rows = [check_arch(a, root) for a in arches]
    return {
        "thresholds": {"max_ulp": MAX_ULP, "max_value_ulp": MAX_VALUE_ULP, "max_kl": MAX_KL},
        "cache_dtype": str(CACHE_DTYPE).removeprefix("torch."),
        "rows": rows,
        "ok": all(r["ok"] for r in rows),
    }


def _table(report: dict[str, Any]) -> str:
    cols = ["arch", "relocate_max_ulp", "relocate_mean_ulp", "kl_relocated", "patch_full_rank_max_ulp", "ok"]
    rows = [[f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in report["rows"]]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in [cols, *rows]]
    return "\n".join([*lines, f"ok: {report['ok']}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orbitkv check operator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--arch", action="append", choices=ARCHES, help="only these arches (repeatable)")
    parser.add_argument("--models-dir", help="reuse / keep the generated model directories here")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    report = run_checks(tuple(args.arch or ARCHES), args.models_dir)
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
