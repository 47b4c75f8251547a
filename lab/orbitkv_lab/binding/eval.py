"""Accuracy of the binding model under the reuse arms, single-hop and multi-hop separately.

Arms (all feed the same two question tokens after a constructed KV cache, with explicit
``position_ids``):

* ``ceiling``  -- full prefill ``[BOS] A B``: ``KV(B|A)``.
* ``blind``    -- B prefilled after the anchor only (``[BOS] B``), keys relocated exactly by
  ``delta = len(A)`` with ``kernels.relocate.relocate``, placed after A's (exact) KV.
* ``patch@m``  -- blind + the rank-``m`` oracle conditioning patch, per layer, K and V: the
  deficit ``KV(B|A) - R(delta) KV(B|anchor)`` of the item itself, truncated SVD by
  ``kernels.patch.form_patch``, added with ``kernels.patch.apply_patch``.
* ``transfer@m`` -- the rank-``m`` patch formed on a *different* item with the *same* A, applied
  as is (its rows are that item's B tokens).
* ``basis@m``  -- the donor item's rank-``m`` directions (``w``) with this item's own
  coefficients (``u = deficit @ w.T``): are the directions shared across items?
* ``baseline`` -- no A at all: ``[BOS] B`` then the question.

    python -m orbitkv_lab.binding.eval --n 200 --legends 40 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from orbitkv.kernels.patch import apply_patch, form_patch
from orbitkv.kernels.relocate import relocate
from orbitkv.kernels.rope import RopeSpec

from . import task

ASSET_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "binding"
)
RANKS = (1, 2, 4, 8, 16, 32)


def load_model(path: str = ASSET_DIR):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _kv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = model(input_ids=ids, use_cache=True)
    c = out.past_key_values
    return [(layer.keys, layer.values) for layer in c.layers]


def _answer(model, kv, items, start: int) -> torch.Tensor:
    """Logits of the answer after feeding the question at positions ``start, start+1``."""
    from transformers import DynamicCache

    cache = DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in kv])
    q = torch.tensor(np.stack([it.question for it in items]))
    pos = torch.arange(start, start + task.Q_LEN)[None].expand(len(items), -1)
    return model(input_ids=q, past_key_values=cache, position_ids=pos).logits[:, -1].float()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[b, H, N, D] -> [b, N, H, D]"""
    return x.permute(0, 2, 1, 3)


def _cols(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 2, 1, 3).contiguous()


@torch.no_grad()
def run_arms(model, items: list[task.Item], ranks=RANKS, donors: list[int] | None = None) -> dict:
    """Answer logits of every arm for ``items`` (all the same shape). ``donors[i]``: index of an
    item with the same A as item ``i`` (for transfer/basis), or None."""
    spec = RopeSpec.from_hf_config(model.config)
    n, a_len, b_len = len(items), task.A_LEN, task.B_LEN
    p0 = task.PREFIX_LEN
    full_ids = torch.tensor(np.stack([np.concatenate([[task.BOS], it.a, it.b]) for it in items]))
    solo_ids = torch.tensor(np.stack([np.concatenate([[task.BOS], it.b]) for it in items]))
    kv_full = _kv(model, full_ids)
    kv_solo = _kv(model, solo_ids)
    T = full_ids.shape[1]

    # per layer: conditioned B rows and relocated canonical B rows, [n, N, H, D]
    cond, reloc, prefix = [], [], []
    for (kf, vf), (ks, vs) in zip(kv_full, kv_solo, strict=True):
        kb, vb = _rows(kf[:, :, p0 + a_len :]), _rows(vf[:, :, p0 + a_len :])
        ksb, vsb = _rows(ks[:, :, p0:]), _rows(vs[:, :, p0:])
        H, D = ksb.shape[2], ksb.shape[3]
        kr = relocate(ksb.reshape(n * b_len, H, D), a_len, spec).reshape(n, b_len, H, D)
        cond.append((kb, vb))
        reloc.append((kr, vsb))
        prefix.append((kf[:, :, : p0 + a_len], vf[:, :, : p0 + a_len]))

    def assemble(rows):
        return [
            (torch.cat([pk, _cols(k)], 2), torch.cat([pv, _cols(v)], 2))
            for (pk, pv), (k, v) in zip(prefix, rows, strict=True)
        ]

    logits = {
        "ceiling": _answer(model, assemble(cond), items, T),
        "blind": _answer(model, assemble(reloc), items, T),
        "baseline": _answer(model, kv_solo, items, p0 + b_len),
    }

    # patches: one max-rank factorization per (item, layer, K/V), truncated per rank
    mmax = max(ranks)
    factors = []  # [layer][kv] -> list over items of (u, w, total_energy)
    energy = {m: [] for m in ranks}
    rel_norm = []
    for (kb, vb), (kr, vr) in zip(cond, reloc, strict=True):
        per = []
        for c, r in ((kb, kr), (vb, vr)):
            lst = []
            for i in range(n):
                d = (c[i].float() - r[i].float()).reshape(b_len, -1)
                pf = form_patch(d, mmax)
                tot = float(d.square().sum())
                lst.append((pf.u, pf.w, d, tot))
                for m in ranks:
                    energy[m].append(float(pf.u[:, :m].square().sum()) / tot if tot > 0 else 1.0)
            per.append(lst)
        rel_norm.append(
            float((kb.float() - kr.float()).norm() / kb.float().norm()),
        )
        factors.append(per)

    def patched(m: int, mode: str):
        rows = []
        for li, (kr, vr) in enumerate(reloc):
            out = []
            for x, lst in ((kr, factors[li][0]), (vr, factors[li][1])):
                ys = []
                for i in range(n):
                    u, w, d, _ = lst[i]
                    if mode == "own":
                        uu, ww = u[:, :m], w[:m]
                    else:
                        j = donors[i]
                        ud, wd = lst[j][0][:, :m], lst[j][1][:m]
                        uu, ww = (ud, wd) if mode == "transfer" else (d @ wd.T, wd)
                    ys.append(apply_patch(x[i].contiguous(), uu.contiguous(), ww.contiguous()))
                out.append(torch.stack(ys))
            rows.append(tuple(out))
        return assemble(rows)

    for m in ranks:
        logits[f"patch@{m}"] = _answer(model, patched(m, "own"), items, T)
        if donors is not None:
            logits[f"transfer@{m}"] = _answer(model, patched(m, "transfer"), items, T)
            logits[f"basis@{m}"] = _answer(model, patched(m, "basis"), items, T)
    diag = {
        "deficit_rel_norm_k_per_layer": rel_norm,
        "deficit_energy_captured": {m: float(np.mean(v)) for m, v in energy.items()},
    }
    return logits, diag


def donors_same_a(items: list[task.Item]) -> list[int]:
    """For each item, the next item (cyclically) with the same legend A."""
    keys = [it.a.tobytes() for it in items]
    out = []
    for i, k in enumerate(keys):
        same = [j for j in range(len(items)) if keys[j] == k and j != i]
        if not same:
            raise ValueError("transfer needs repeated A's (make_eval_set(..., legends=L))")
        later = [j for j in same if j > i]
        out.append(later[0] if later else same[0])
    return out


def evaluate(
    model, items: list[task.Item], ranks=RANKS, transfer: bool = True, batch: int = 150
) -> dict:
    """Accuracy (and KL to the ceiling) per arm: single-hop A, single-hop B, multi-hop, traps."""
    if transfer:
        donors_same_a(items)  # fail early when A's do not repeat
    all_logits: dict[str, list] = {}
    diags = []
    # batch over items; donors must be inside the batch -> group by legend
    order = (
        sorted(range(len(items)), key=lambda i: items[i].a.tobytes())
        if transfer
        else list(range(len(items)))
    )
    chunks = [order[s : s + batch] for s in range(0, len(order), batch)]
    if transfer:  # keep each legend's items together
        groups: dict[bytes, list[int]] = {}
        for i in order:
            groups.setdefault(items[i].a.tobytes(), []).append(i)
        chunks, cur = [], []
        for g in groups.values():
            if cur and len(cur) + len(g) > batch:
                chunks.append(cur)
                cur = []
            cur += g
        if cur:
            chunks.append(cur)
    idx_all = []
    for ch in chunks:
        sub = [items[i] for i in ch]
        dn = donors_same_a(sub) if transfer else None
        lg, dg = run_arms(model, sub, ranks, dn)
        diags.append(dg)
        for k, v in lg.items():
            all_logits.setdefault(k, []).append(v)
        idx_all += ch
    inv = np.argsort(idx_all)
    logits = {k: torch.cat(v)[torch.from_numpy(inv)] for k, v in all_logits.items()}
    ans = torch.tensor([it.answer for it in items])
    groups = {
        "single_A": [i for i, it in enumerate(items) if it.qtype == "A"],
        "single_B": [i for i, it in enumerate(items) if it.qtype == "E"],
        "single": [i for i, it in enumerate(items) if it.qtype != "M"],
        "multi": [i for i, it in enumerate(items) if it.qtype == "M"],
        "multi_trap": [i for i, it in enumerate(items) if it.qtype == "M" and it.trap],
    }
    ref = torch.log_softmax(logits["ceiling"], -1)
    res: dict = {"n": {g: len(ix) for g, ix in groups.items()}, "acc": {}, "kl": {}}
    for arm, lg in logits.items():
        correct = (lg.argmax(-1) == ans).numpy()
        lp = torch.log_softmax(lg, -1)
        kl = (ref.exp() * (ref - lp)).sum(-1).numpy()
        res["acc"][arm] = {g: float(correct[ix].mean()) for g, ix in groups.items()}
        res["kl"][arm] = {g: float(kl[ix].mean()) for g, ix in groups.items()}
    res["diag"] = {
        "deficit_rel_norm_k_per_layer": np.mean(
            [d["deficit_rel_norm_k_per_layer"] for d in diags], 0
        ).tolist(),
        "deficit_energy_captured": {
            m: float(np.mean([d["deficit_energy_captured"][m] for d in diags])) for m in ranks
        },
    }
    return res


def format_table(res: dict) -> str:
    cols = ["single_A", "single_B", "single", "multi", "multi_trap"]
    lines = [
        "arm          " + " ".join(f"{c:>10}" for c in cols) + "   KL(multi)",
        "n            " + " ".join(f"{res['n'][c]:>10}" for c in cols),
    ]
    for arm, acc in res["acc"].items():
        lines.append(
            f"{arm:<13}"
            + " ".join(f"{acc[c]:>10.3f}" for c in cols)
            + f"   {res['kl'][arm]['multi']:.4f}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=ASSET_DIR)
    ap.add_argument("--n", type=int, default=200, help="items per question type")
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--legends", type=int, default=40, help="distinct A's (items share them)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    items = task.make_eval_set(args.seed, args.n, legends=args.legends)
    t0 = time.time()
    res = evaluate(model, items)
    res["seconds"] = time.time() - t0
    res["args"] = vars(args)
    print(format_table(res))
    print(json.dumps(res["diag"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
