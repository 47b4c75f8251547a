"""``orbitkv check window [--json]``: the window operations in vLLM (CPU), against re-prefill.

With a tiny seeded SmolVLM in an in-process engine, for each window operation — ``slide`` (one
image out, one in), every non-identity ``reorder`` of three images, ``recall`` (an image evicted one
step earlier comes back) — the items the new window shares with the old ones are served by each arm
and compared with a full re-prefill of the same prompt (connector off):

- ``blind``: the item's canonical ``KV(B|anchor)``, relocated;
- ``relocate``: the item's entry from its old context, relocated (survivor / transfer);
- ``transfer``: what the planner serves with the ``survivor`` and ``transfer`` modes allowed,
  transfer for images (the closest stored antecedent per item; ``served`` says which mode) and for
  text behind the same chunk as before (the question, on a reorder that keeps the last image);
- ``patched`` at ranks 8, 16, 32, 64 and full: canonical + a patch formed against the re-prefill's
  KV of the item (the patch a live request would store for this antecedent), relocated;
- ``recompute``: the re-prefill itself (its row checks the harness: zero error).

Canonicals come from canonicalize requests (``role: canonicalize``), one per image. Per row:
``op``, ``arm``, ``rank`` (``"full"`` for full rank), ``kv_rel_error`` per layer (all prompt tokens,
gathered from the paged cache), ``item_kv_*`` (the served items' rows alone: relative error per
layer, values that differ, their largest ULP distance, and ``item_kv_num_off``, values off by more
than one ULP and one ULP at the layer's RMS), next-token ``kl`` (full-vocabulary logprobs),
``greedy_agreement`` over 32 tokens (and ``greedy_prefix``, the tokens before the first
divergence), ``stored_bytes_fraction`` (entry + patch bytes over the items' KV bytes),
``patch_bytes_fraction`` (the patch alone), ``is_full_rank`` (the rank reaches min(tokens,
features) of every item: such a patch is the conditioned KV re-encoded, not an approximation),
``eta`` (the share of the blind-to-re-prefill KL gap closed), ``eta_relocate`` (the same against
relocate-only) and ``served`` (the modes OrbitKV reported, proof that the arm was served as
intended). ``ok`` (``window_report.verdict``): the full-rank patch gives back the items' KV
(``item_kv_num_off`` 0) with KL <= 1e-3, and the error falls monotonically with rank.

``--size tiny`` (the default, the test's) has 16-token images, where rank 16 is already full;
``--size bench --image-size 192`` measures patches below full rank (144-token images, 256 features
per side). See ``docs/fidelity.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orbitkv.checks.engine import OFF, InProcessEngine, Run, engine
from orbitkv_lab.checks.window_report import at_rank, break_even, format_table, op_facts, verdict

SYSTEM = "You are an agent. Compare the screenshots in order and answer briefly."
QUESTION = "Which screenshot is different from the others?"
RANKS: tuple[int | str, ...] = (8, 16, 32, 64, "full")
FULL_RANK = 4096  # form_patch caps it at min(tokens, features): the full rank
NUM_TOKENS = 32


def image_url(seed: int, size: int = 64) -> str:
    import base64
    import io

    from PIL import Image

    pixels = np.random.RandomState(seed).rand(size, size, 3) * 255
    buf = io.BytesIO()
    Image.fromarray(pixels.astype("uint8")).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(window: Sequence[str]) -> list[dict[str, Any]]:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in window]
    content.append({"type": "text", "text": QUESTION})
    return [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
            {"role": "user", "content": content}]


def operations(ops: Sequence[str]) -> list[tuple[str, list[list[int]], list[int]]]:
    """(name, earlier windows run with the connector on, the new window) per operation."""
    out = []
    if "slide" in ops:
        out.append(("slide", [[0, 1, 2]], [1, 2, 3]))
    perms = [p for p in itertools.permutations([0, 1, 2]) if list(p) != [0, 1, 2]]
    for op in ops:
        name, _, which = op.partition(":")  # "reorder" (all five) or "reorder:201" (one)
        if name != "reorder":
            continue
        for perm in perms:
            label = "".join(map(str, perm))
            if not which or which == label:
                out.append((f"reorder {label}", [[0, 1, 2]], list(perm)))
    if "recall" in ops:
        out.append(("recall", [[0, 1, 2], [1, 2, 3]], [2, 3, 0]))
    return out


def _kv_all(eng: InProcessEngine, run: Run, end: int) -> list[torch.Tensor]:
    out = []
    for layer in range(eng.num_layers):
        k, v = eng.kv(run.block_ids, 0, end, layer)
        out.append(torch.cat([k.float().flatten(), v.float().flatten()]))
    return out


def _kv_items(eng: InProcessEngine, run: Run, items: list[Any]) -> list[torch.Tensor]:
    """Per layer, the served items' K and V rows in the cache's own dtype, flattened."""
    out = []
    for layer in range(eng.num_layers):
        parts = []
        for c in items:
            k, v = eng.kv(run.block_ids, c.start, c.end, layer)
            parts += [k.flatten(), v.flatten()]
        out.append(torch.cat(parts))
    return out


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Units in the last place between same-dtype floats: distance in their ordered bit patterns."""
    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view({2: torch.int16, 4: torch.int32}[x.element_size()]).long()
        sign = 1 << (8 * x.element_size() - 1)
        return torch.where(bits < 0, -(bits & (sign - 1)), bits)

    return (ordered(a) - ordered(b)).abs()


def _num_off(got: torch.Tensor, want: torch.Tensor, ulps: torch.Tensor) -> int:
    """Values further than one ULP from ``want`` and than one ULP at the layer's RMS magnitude: a
    full-rank patch rounds an fp32 sum whose SVD reconstruction is off by ~1e-6 of the deficit,
    which may move a near-zero value by a few of its own (tiny) ULPs but nothing further."""
    want_f = want.float()
    atol = torch.finfo(want.dtype).eps * float(want_f.square().mean().sqrt())
    return int(((ulps > 1) & ((got.float() - want_f).abs() > atol)).sum())


def _logprobs(run: Run) -> torch.Tensor:
    first = run.output.outputs[0].logprobs[0]
    ids = sorted(first)
    lp = torch.full((max(ids) + 1,), -math.inf, dtype=torch.float64)
    for i in ids:
        lp[i] = first[i].logprob
    return lp


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    n = max(p_log.shape[0], q_log.shape[0])
    p = torch.full((n,), -math.inf, dtype=torch.float64)
    q = p.clone()
    p[: p_log.shape[0]], q[: q_log.shape[0]] = p_log, q_log
    mask = torch.isfinite(p)
    return float((p[mask].exp() * (p[mask] - q[mask].clamp_min(-1e4))).sum())


def _items(chunks: list[Any], window: Sequence[str], served: set[str]) -> list[Any]:
    images = [c for c in chunks if c.is_mm]
    assert len(images) == len(window), "one chunk per image"
    return [c for c, url in zip(images, window, strict=True) if url in served]


class WindowCheck:
    def __init__(self, eng: InProcessEngine, config: Any, ranks: Sequence[int | str]) -> None:
        self.eng = eng
        self.config = config
        self.ranks = list(ranks)
        self.identity = eng.worker._identity
        ident = self.identity
        # A patch factors each layer's [tokens, features] deficit per side (MLA: one latent row).
        self.num_features = ident.head_dim if ident.is_mla else ident.num_kv_heads * ident.head_dim
        self.timings: dict[str, list[float]] = {"canonicalize_s": [], "form_s": []}
        self.facts: dict[str, dict[str, Any]] = {}

    def canonicalize(self, urls: Sequence[str]) -> None:
        for url in urls:
            msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
            started = time.perf_counter()
            run = self.eng.chat(msgs, {"orbitkv": {"role": "canonicalize"}})
            self.timings["canonicalize_s"].append(time.perf_counter() - started)
            status = run.summary.get("canonicalize", {}).get("status")
            if status not in ("formed", "already stored"):
                raise RuntimeError(f"canonicalize failed: {run.summary.get('canonicalize')}")

    def _arm(self, name: str, rank: Any, target: list[str], params: dict[str, Any] | None,
             ref: dict[str, Any], served_items: list[Any], extra_nbytes: int) -> dict[str, Any]:
        started = time.perf_counter()
        run = self.eng.chat(messages(target), params, max_tokens=NUM_TOKENS, logprobs=-1)
        wall_s = time.perf_counter() - started
        kv = _kv_all(self.eng, run, ref["num_tokens"])
        errors = [float((a - b).norm() / b.norm()) for a, b in zip(kv, ref["kv"], strict=True)]
        # The served items alone: what the arm loaded, before it spreads to later tokens.
        items_kv = _kv_items(self.eng, run, ref["items"])
        item_errors = [float((a.float() - b.float()).norm() / b.float().norm())
                       for a, b in zip(items_kv, ref["items_kv"], strict=True)]
        ulps = [_ulps(a, b) for a, b in zip(items_kv, ref["items_kv"], strict=True)]
        num_off = sum(_num_off(a, b, u) for a, b, u in zip(items_kv, ref["items_kv"], ulps, strict=True))
        tokens = list(run.output.outputs[0].token_ids)
        same = [a == b for a, b in zip(tokens, ref["tokens"], strict=False)]
        item_nbytes = ref["item_nbytes"]
        is_patched = name == "patched"
        return {
            "arm": name,
            "rank": rank,
            "kv_rel_error": [round(e, 7) for e in errors],
            "item_kv_rel_error": [round(e, 7) for e in item_errors],
            "item_kv_max_ulps": int(max(int(u.max()) for u in ulps)) if ref["items"] else 0,
            "item_kv_num_differ": sum(int((u > 0).sum()) for u in ulps),
            "item_kv_num_off": num_off,
            "item_kv_num_values": sum(u.numel() for u in ulps),
            "kl": _kl(ref["logprobs"], _logprobs(run)),
            "greedy_agreement": sum(same) / NUM_TOKENS,
            "greedy_prefix": next((i for i, ok in enumerate(same) if not ok), len(same)),
            "stored_bytes_fraction": round((item_nbytes + extra_nbytes) / item_nbytes, 4) if params else None,
            "patch_bytes_fraction": round(extra_nbytes / item_nbytes, 4) if is_patched else None,
            "is_full_rank": is_patched and (rank == "full" or int(rank) >= ref["full_rank"]),
            "served": run.summary.get("reused_tokens_by_mode", {}),
            "wall_s": round(wall_s, 4),
            "num_served_item_tokens": sum(c.length for c in served_items),
        }

    def run_op(self, name: str, earlier: list[list[int]], new: list[int], urls: list[str]) -> list[dict]:
        from orbitkv.connector.scheduler.admission import canonical_context
        from orbitkv.connector.worker.patching import PatchFormer
        from orbitkv.store.keys import canonical_key, conditioned_key

        before_runs = [self.eng.chat(messages([urls[i] for i in w])) for w in earlier]
        target = [urls[i] for i in new]
        shared = {urls[i] for i in new} & {urls[i] for w in earlier for i in w}
        ref_run = self.eng.chat(messages(target), OFF, max_tokens=NUM_TOKENS, logprobs=-1)
        n = len(ref_run.output.prompt_token_ids) - 1
        items = _items(ref_run.chunks, target, shared)
        ref = {
            "num_tokens": n,
            "kv": _kv_all(self.eng, ref_run, n),
            "tokens": list(ref_run.output.outputs[0].token_ids),
            "logprobs": _logprobs(ref_run),
            "items": items,
            "items_kv": _kv_items(self.eng, ref_run, items),
        }
        ident = self.identity
        per_token = ident.num_kv_heads * ident.head_dim * 2 * ident.cache_dtype.itemsize
        ref["item_nbytes"] = sum(c.length for c in items) * per_token * ident.num_layers
        ref["full_rank"] = min([self.num_features, *(c.length for c in items)])
        rows = [self._arm("recompute", None, target, OFF, ref, [], 0)]
        rows.append(self._arm("blind", None, target, {"orbitkv": {"modes": ["exact", "blind"], "save": False}}, ref, items, 0))
        # relocate: each item's entry from the context it was last computed in, under this key.
        last_key: dict[str, str] = {}
        for w, run in zip(earlier, before_runs, strict=True):
            for c, i in zip([c for c in run.chunks if c.is_mm], w, strict=True):
                last_key[urls[i]] = conditioned_key(c.cid, c.antecedent_hash)
        moved = [conditioned_key(c.cid, c.antecedent_hash) for c in items]
        urls_of = {c.cid: u for c, u in zip([c for c in ref_run.chunks if c.is_mm], target, strict=True)}
        raw = self.eng.store.get_bytes([last_key[urls_of[c.cid]] for c in items])
        self.eng.store.put_bytes([(k, bytes(b)) for k, b in zip(moved, raw, strict=True) if b is not None])
        rows.append(self._arm("relocate", None, target, {"orbitkv": {"modes": ["exact"], "save": False}}, ref, items, 0))
        self.eng.store.delete(moved)
        # transfer: what OrbitKV's planner serves itself with survivor and transfer allowed.
        rows.append(self._arm("transfer", None, target, {"orbitkv": {"modes": ["exact", "survivor", "transfer"], "save": False}}, ref, items, 0))
        for rank in self.ranks:
            r = FULL_RANK if rank == "full" else int(rank)
            former = PatchFormer(self.eng.store, ident, _with(self.config, patch_rank=r))
            keys, nbytes = [], 0
            context = canonical_context(ident)
            canon = self.eng.store.get([canonical_key(c.cid, context) for c in items])
            for c, canonical in zip(items, canon, strict=True):
                tensors = {}
                for layer in range(ident.num_layers):
                    k, v = self.eng.kv(ref_run.block_ids, c.start, c.end, layer)
                    tensors[f"k.{layer}"], tensors[f"v.{layer}"] = k, v
                started = time.perf_counter()
                patch = former.exact_patch(tensors, c.start, canonical, c.antecedent)
                if r == self.config.patch_rank:
                    self.timings["form_s"].append(time.perf_counter() - started)
                if patch is None:
                    raise RuntimeError(f"no patch at rank {rank} for an item (canonical missing?)")
                key = former.keys(c.cid, c.antecedent)[0]
                self.eng.store.put(key, patch)
                keys.append(key)
                nbytes += sum(t.numel() * t.element_size() for t in patch.tensors.values())
            params = {"orbitkv": {"modes": ["exact", "patched"], "patch_rank": r, "save": False}}
            rows.append(self._arm("patched", rank, target, params, ref, items, nbytes))
            self.eng.store.delete(keys)
        kl_blind, kl_relocate = rows[1]["kl"], rows[2]["kl"]
        for row in rows:
            row["op"] = name
            row["eta"] = None if kl_blind <= 1e-12 else round(1.0 - row["kl"] / kl_blind, 6)
            row["eta_relocate"] = None if kl_relocate <= 1e-12 else round(1.0 - row["kl"] / kl_relocate, 6)
        self.facts[name] = op_facts([c.length for c in items], self.num_features, rows)
        return rows


def _with(config: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(config, patch_max_bytes_fraction=1e6, **changes)


def run_check(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    from orbitkv.config import OrbitKVConfig
    from orbitkv.models.make_model import image_seq_len, make_model, width_scaled_std
    from orbitkv.serving.anchor import chat_anchor_tokens

    workdir = Path(args.workdir)
    size, image_size = args.size, args.image_size
    init_std = width_scaled_std(size) if args.init_std is None else args.init_std
    name = f"smolvlm-{size}" + ("" if image_size is None else f"-{image_size}px") + f"-std{init_std:.4g}"
    # Seeded weights at every size: outputs are compared, and vLLM's dummy weights decode flat.
    model_dir = make_model(workdir / name, "smolvlm", size, weights=True, image_size=image_size, init_std=init_std)
    edge = json.loads((model_dir / "config.json").read_text())["vision_config"]["image_size"]
    ranks = [r if r == "full" else int(r) for r in args.ranks.split(",")]
    # One user measuring approximate arms: approximate KV for every request of this engine;
    # transfer scoped as bench agent's window policy: images, and text behind the same chunk.
    extra = {"chunk_size": 64, "local_cpu": True, "max_local_cpu_size": 0.5,
             "orbitkv": {"anchor_tokens": chat_anchor_tokens(model_dir), "patch_rank": 32,
                         "approximate_reuse": "all", "require_calibration": False, "transfer_modalities": ["image"],
                         "transfer_attached_modalities": ["text"]}}
    config = OrbitKVConfig.from_kv_connector_extra_config(dict(extra))
    ops = operations([o.strip() for o in args.ops.split(",")])
    rows: list[dict[str, Any]] = []
    with engine(model_dir, extra, max_logprobs=-1, limit_mm_per_prompt={"image": 4}) as eng:
        check = WindowCheck(eng, config, ranks)
        ident = check.identity
        model = {"name": f"{name} (seeded)", "num_layers": ident.num_layers, "num_kv_heads": ident.num_kv_heads,
                 "head_dim": ident.head_dim, "num_features_per_side": check.num_features, "init_std": init_std,
                 "image_size_px": edge, "image_tokens": image_seq_len(model_dir)}
        for k, (op, earlier, new) in enumerate(ops):
            urls = [image_url(100 * k + i, edge) for i in range(4)]
            # Only the items the new window shares with earlier ones: every arm serves those,
            # and a new item (no canonical) is computed in every arm alike.
            check.canonicalize(sorted({urls[i] for w in earlier for i in w} & {urls[i] for i in new}))
            log(f"[check window] {op}")
            rows += check.run_op(op, earlier, new, urls)
    return {"model": model, "ranks": ranks, "rows": rows, "ops": check.facts,
            "at_patch_rank": at_rank(rows, config.patch_rank),
            "break_even": break_even(rows, check.timings, config.patch_rank), **verdict(rows, ranks)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="orbitkv check window", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    p.add_argument("--out", help="also write the JSON to this file (vLLM logs to stdout too)")
    p.add_argument("--ops", default="slide,reorder,recall")
    p.add_argument("--ranks", default=",".join(map(str, RANKS)))
    p.add_argument("--workdir", default=".orbitkv/check-window")
    p.add_argument("--size", default="tiny", choices=("tiny", "bench"),
                   help="SmolVLM text stack: tiny (4 layers, 64 features/side) or bench (16 layers, 256)")
    p.add_argument("--image-size", type=int, default=None,
                   help="vision input edge in px: (px/16)^2 image tokens (default: the size's own, 64 or 128)")
    p.add_argument("--init-std", type=float, default=None,
                   help="random weights' std (default: tiny's attention-logit scale at this width, "
                        "make_model.width_scaled_std: 0.07 tiny, 0.0247 bench)")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    out = sys.stderr if args.json else sys.stdout
    doc = run_check(args, lambda msg: print(msg, file=out, flush=True))
    print(format_table(doc), file=out)
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
