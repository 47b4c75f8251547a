"""Run every arm on one arch's prompts and pool the measures (the JSON ``arches[]`` rows)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from orbitkv.models import hfrun

from . import arms, metrics, partial, prompts, selection

SCHEMA_VERSION = 1
BINDING_DIR = str(Path(__file__).resolve().parent.parent / "assets" / "binding")


@dataclasses.dataclass
class LabConfig:
    prompt: prompts.PromptConfig = dataclasses.field(default_factory=prompts.PromptConfig)
    ranks: tuple[int, ...] = (
        2,
        4,
        8,
        16,
        32,
        64,
    )  # 8..64 asked; 2, 4 match the token arms' low bytes
    deep_rank: int = 32
    cacheblend: tuple[float, ...] = (0.05, 0.15, 0.5)
    vlcache_targets: tuple[float, ...] = (0.02, 0.10)
    mpic_k: int = 32
    epic_k: int = 16
    first_k_ref: int = 512  # k tokens of a 512-token chunk at full scale, scaled to ours
    shiftkv_budgets: tuple[int, ...] = (64, 256)
    capsule_ratios: tuple[float, ...] = (0.25, 0.5)
    n_calib: int = 4
    energy_ranks: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    binding_per_type: int = 20

    @classmethod
    def quick(cls) -> LabConfig:
        return cls(
            prompts.PromptConfig(n_items=2, chunk_len=16, question_len=4, image_px=64),
            ranks=(8, 16),
            cacheblend=(0.15, 1.0),
            vlcache_targets=(0.10,),
            n_calib=2,
            shiftkv_budgets=(256,),
            capsule_ratios=(0.5,),
            binding_per_type=2,
        )


def load_arch(arch: str, models_dir: Path, binding_dir: str | None = None) -> hfrun.HFModel:
    if arch == "binding":
        from orbitkv.kernels.rope import RopeSpec
        from transformers import LlamaForCausalLM

        # As orbitkv_lab.binding.load_model does (not imported: its eval module imports the bare
        # top-level ``kernels`` package, absent when run from an installed console script).
        model = LlamaForCausalLM.from_pretrained(
            binding_dir or BINDING_DIR, dtype=torch.float32
        ).eval()
        hm = hfrun.HFModel(
            "binding", model, model.config, None, RopeSpec.from_hf_config(model.config)
        )
    else:
        from orbitkv.models.make_model import ensure_models

        hm = hfrun.load(ensure_models(models_dir, (arch,))[arch])
        size = getattr(hm.image_processor, "size", None)
        if getattr(size, "longest_edge", None) is not None:
            # The tiny processor caps images at 4096 pixels (16 tokens); allow up to 128x128.
            size.longest_edge = 128 * 128
    partial.install(hm)
    return hm


def make_items(hm, cfg: LabConfig) -> tuple[list[prompts.Item], list[prompts.Item]]:
    if hm.arch == "binding":
        items = prompts.binding_items(hm, cfg.binding_per_type, seed=cfg.prompt.seed)
        calib = prompts.binding_items(hm, max(1, cfg.n_calib // 3), seed=cfg.prompt.seed + 1000)
        return items, calib
    calib_cfg = dataclasses.replace(cfg.prompt, n_items=cfg.n_calib)
    return prompts.make_items(hm, cfg.prompt), prompts.make_items(hm, calib_cfg, seed_offset=1)


def run_item(hm, item: prompts.Item, cfg: LabConfig, cal: dict[str, Any]) -> list[arms.ArmResult]:
    layers = len(item.ceiling_kv)
    out = [arms.ceiling(hm, item), arms.blind(hm, item), arms.relocate_only(hm, item)]
    out += [arms.patch(hm, item, m) for m in cfg.ranks]
    out.append(arms.patch(hm, item, arms.full_rank(item), name="patch@full"))
    deep = set(range(layers // 2, layers))
    out.append(arms.patch(hm, item, cfg.deep_rank, deep, name=f"patch-deep@{cfg.deep_rank}"))
    out += [arms.cacheblend(hm, item, r) for r in cfg.cacheblend]
    out += [arms.vlcache(hm, item, sched, name) for name, sched in cal["vlcache"].items()]
    out.append(arms.mpic(hm, item, cfg.mpic_k, cfg.first_k_ref))
    out.append(arms.epic(hm, item, cfg.epic_k, cfg.first_k_ref))
    for c in cfg.shiftkv_budgets:
        out.append(
            selection.shiftkv(
                hm, item, c, selection.shiftkv_budget(item, c, cal["shiftkv"]), cal["shiftkv"]
            )
        )
    out += [selection.capsule(hm, item, cap) for cap in cal["capsules"]]
    return out


def calibrate(hm, calib: list[prompts.Item], cfg: LabConfig) -> dict[str, Any]:
    sens = selection.vlcache_sensitivity(hm, calib)
    scheds = {
        f"vlcache@{round(t * 100)}%": selection.vlcache_schedule(sens, t)
        for t in cfg.vlcache_targets
    }
    caps = [selection.fit_capsule(hm, calib, r) for r in cfg.capsule_ratios]
    return {
        "vlcache": scheds,
        "vlcache_sensitivity": sens,
        "shiftkv": selection.ShiftKVConfig(),
        "capsules": caps,
    }


def _interp(curve: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear value of the patch's (extra bytes, eta) curve at ``x`` (flat past its end)."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:], strict=False):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[-1][1]


def run_arch(
    arch: str, cfg: LabConfig, models_dir: Path, binding_dir: str | None = None
) -> dict[str, Any]:
    t0 = time.perf_counter()
    torch.manual_seed(0)
    hm = load_arch(arch, models_dir, binding_dir)
    items, calib = make_items(hm, cfg)
    cal = calibrate(hm, calib, cfg)
    per_item = [run_item(hm, it, cfg, cal) for it in items]
    names = [a.name for a in per_item[0]]
    kls = {
        n: [
            metrics.kl(it.ceiling_logits, res[i].logits)
            for it, res in zip(items, per_item, strict=True)
        ]
        for i, n in enumerate(names)
    }
    ans = {n: [int(res[i].logits.argmax()) for res in per_item] for i, n in enumerate(names)}
    ceil_ans = [int(it.ceiling_logits.argmax()) for it in items]
    kl_blind, kl_reloc = sum(kls["blind"]), sum(kls["relocate"])
    rows = []
    for i, n in enumerate(names):
        res = [r[i] for r in per_item]
        row: dict[str, Any] = {
            "arm": n,
            "family": res[0].family,
            "kl": sum(kls[n]) / len(items),
            "kl_items": kls[n],
            "eta": metrics.eta(sum(kls[n]), kl_blind),
            "eta_vs_relocate": metrics.eta(sum(kls[n]), kl_reloc),
            "extra_bytes": sum(r.extra_bytes for r in res) / len(res),
            "stored_bytes": sum(r.stored_bytes for r in res) / len(res),
            "extra_tokens": sum(r.extra_tokens for r in res) / len(res),
            "kv_rel_err_by_layer": [
                sum(x) / len(x)
                for x in zip(
                    *[
                        metrics.kv_rel_err(r.kv, it.ceiling_kv, it.chunk_rows[: it.n_prefix])
                        for r, it in zip(res, items, strict=True)
                    ],
                    strict=True,
                )
            ],
        }
        fb = metrics.flips(ceil_ans, ans["blind"], ans[n])
        fr = metrics.flips(ceil_ans, ans["relocate"], ans[n])
        row.update(
            flip_recover=fb["flip_recover"],
            flip_recover_vs_relocate=fr["flip_recover"],
            agree=fb["agree"],
        )
        if items[0].answer is not None:
            row["accuracy"] = sum(
                a == it.answer for a, it in zip(ans[n], items, strict=True)
            ) / len(items)
            for qt in sorted({it.qtype for it in items}):
                sub = [(a, it) for a, it in zip(ans[n], items, strict=True) if it.qtype == qt]
                row[f"accuracy_{qt}"] = sum(a == it.answer for a, it in sub) / len(sub)
        rows.append(row)
    for key in ("eta", "eta_vs_relocate"):
        curve = sorted(
            (r["extra_bytes"], r[key])
            for r in rows
            if r["arm"] == "relocate" or (r["family"] == "patch" and r["arm"].startswith("patch@"))
        )
        for r in rows:
            if r["family"] in ("token", "patch"):
                r[f"patch_{key}_at_same_bytes"] = _interp(curve, r["extra_bytes"])
    defs = [d for it in items for c in range(1, len(it.chunks)) for d in arms.deficits(it, c)]
    full = max(min(d.shape) for d in defs)
    fb = metrics.flips(ceil_ans, ans["blind"], ans["blind"])
    fr = metrics.flips(ceil_ans, ans["relocate"], ans["relocate"])
    return {
        "arch": arch,
        "n_items": len(items),
        "n_calib": len(calib),
        "prompt_tokens": sum(len(it.prompt) for it in items) / len(items),
        "reused_tokens": sum(int(it.chunk_rows.sum()) for it in items) / len(items),
        "chunks": len(items[0].chunks),
        "layers": len(items[0].ceiling_kv),
        "canonical_bytes": arms.chunk_bytes(items[0]),
        "row_bytes": arms.row_bytes(items[0].ceiling_kv),
        "flip_rate_blind": fb["flip_rate"],
        "flip_rate_relocate": fr["flip_rate"],
        "n_flipped_blind": fb["n_flipped"],
        "energy_by_rank": metrics.energy_by_rank(defs, [*cfg.energy_ranks, full]),
        "full_rank": full,
        "vlcache_schedules": cal["vlcache"],
        "shiftkv_scaled_budgets": {
            str(c): selection.shiftkv_budget(items[0], c, cal["shiftkv"])
            for c in cfg.shiftkv_budgets
        },
        "arms": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
