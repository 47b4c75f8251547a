"""``orbitkv bench bytes --json``: under one store budget, canonical + patches against conditioned
entries alone, for images that recur behind several antecedents.

Each of ``--items`` images X comes back behind ``--antecedents`` different images A (a window of two
screenshots, ``[A_j, X_i]``), so its conditioned entries ``KV(X | A_j)`` pile up. Two arms, one
in-process engine each, the same memory-tier budget (``--budget-fraction`` of what every
conditioned entry of the trace would take; ``--budget-fractions`` sweeps it), side by side in one run:

- ``conditioned``: every chunk stored as computed (exact); patches off;
- ``patches``: each X registered (its canonical), a rank-``--rank`` patch of X after A_j formed
  (``--patch-dtype`` factors) and, being smaller, stored in place of ``KV(X | A_j)``
  (``patch_replaces_conditioned``): the store keeps one canonical and small patches per image.

Pass 1 runs every window once (the store fills and evicts, LRU), pass 2 runs them again, newest
first (a cyclic replay in the same order is LRU's worst case: no arm would keep anything), with
vLLM's prefix cache emptied each time. Per arm: bytes stored, prompt tokens served in pass 2 and
per byte stored, the hit rate of X's tokens, and (pass-2 answers against pass 1's, computed in
full) greedy agreement. Ratios, the patches arm's over the conditioned arm's under the same budget:
``ratio_tokens_served`` (every prompt token: A, X and the text around them),
``ratio_x_tokens_served`` (X's tokens alone: what the patches are for) and
``ratio_tokens_served_per_byte``. Seeded weights (``make-model``), so the answers mean something.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from orbitkv_lab.checks.window import image_url, messages

from orbitkv.checks.engine import InProcessEngine, engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="orbitkv bench bytes", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/orbitkv-bench-bytes"))
    p.add_argument("--size", default="bench", choices=("tiny", "bench"))
    p.add_argument("--image-size", type=int, default=192, help="SmolVLM image edge, px")
    p.add_argument("--items", type=int, default=3, help="images that recur (X)")
    p.add_argument("--antecedents", type=int, default=4, help="images each X recurs behind (A)")
    p.add_argument("--budget-fractions", default="0.5,0.7,0.9",
                   help="store budgets to try, each a fraction of every conditioned entry's bytes")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--patch-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    args = p.parse_args(argv)
    report = run(args, log=lambda m: print(m, file=sys.stderr))
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text if args.json else _line(report))
    return 0


def run(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    from orbitkv.models.make_model import image_seq_len, make_model, width_scaled_std
    from orbitkv.serving.anchor import chat_anchor_tokens

    started = time.monotonic()
    model_dir = make_model(args.workdir / f"smolvlm-{args.size}-{args.image_size}px", "smolvlm",
                           args.size, weights=True, image_size=args.image_size,
                           init_std=width_scaled_std(args.size))
    config = json.loads((model_dir / "config.json").read_text())
    text = config["text_config"]
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads", heads))
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    token_nbytes = int(text["num_hidden_layers"]) * 2 * kv_heads * head_dim * 2  # bf16 K and V
    edge = config["vision_config"]["image_size"]
    num_image_tokens = image_seq_len(model_dir)
    windows = [(j, i) for j in range(args.antecedents) for i in range(args.items)]
    # The budgets' unit: every image entry of the trace (each A once, X behind each A; an image
    # chunk is its placeholder tokens and three framing tokens). The windows' text chunks share
    # the budget too, so a fraction of 1 does not hold the whole trace.
    all_nbytes = (args.antecedents + len(windows)) * (num_image_tokens + 3) * token_nbytes
    a_urls = [image_url(1000 + j, edge) for j in range(args.antecedents)]
    x_urls = [image_url(2000 + i, edge) for i in range(args.items)]
    budgets = []
    for fraction in (float(f) for f in args.budget_fractions.split(",")):
        budget = int(fraction * all_nbytes)
        out: dict[str, Any] = {}
        for name, extra in _arms(budget, chat_anchor_tokens(model_dir), args).items():
            log(f"bench bytes: budget {fraction:.2f}, {name}")
            with engine(model_dir, extra, max_logprobs=-1, limit_mm_per_prompt={"image": 2}) as eng:
                out[name] = _arm(eng, windows, a_urls, x_urls, is_registering=name == "patches")
        c, pt = out["conditioned"], out["patches"]
        budgets.append({"budget_fraction": fraction, "budget_nbytes": budget, "arms": out,
                        "ratio_tokens_served_per_byte": _ratio(pt["tokens_served_per_mib"], c["tokens_served_per_mib"]),
                        "ratio_tokens_served": _ratio(pt["tokens_served"], c["tokens_served"]),
                        "ratio_x_tokens_served": _ratio(pt["x_hit_rate"], c["x_hit_rate"])})
    return {
        "model": f"smolvlm {args.size}, {edge}px images ({num_image_tokens} tokens), seeded",
        "config": {"items": args.items, "antecedents": args.antecedents, "rank": args.rank,
                   "patch_dtype": args.patch_dtype, "kv_nbytes_per_token": token_nbytes,
                   "all_conditioned_nbytes": all_nbytes},
        "budgets": budgets,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def _arms(budget: int, anchor: list[int], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    base = {"chunk_size": 64, "local_cpu": True, "max_local_cpu_size": budget / (1 << 30),
            "orbitkv": {"anchor_tokens": anchor, "approximate_reuse": "all", "require_calibration": False, "store_max_antecedents": 64}}
    return {
        "conditioned": {**base, "orbitkv": {**base["orbitkv"], "patch_rank": 0}},
        "patches": {**base, "orbitkv": {**base["orbitkv"], "patch_rank": args.rank,
                                         "patch_dtype": args.patch_dtype, "patch_max_bytes_fraction": 10.0,
                                         "patch_replaces_conditioned": True}},
    }


def _arm(eng: InProcessEngine, windows, a_urls, x_urls, *, is_registering: bool) -> dict[str, Any]:
    if is_registering:
        for url in x_urls:  # each X's canonical: what its patches are formed against
            eng.chat(_lone(url), {"orbitkv": {"role": "canonicalize"}})
    first = {}
    for j, i in windows:
        first[(j, i)] = eng.chat(messages([a_urls[j], x_urls[i]]), max_tokens=8)
    eng.flush()
    nbytes = eng.store.stats().get("memory.used_nbytes", 0)
    served = prompt = x_served = x_total = agree = 0
    modes: dict[str, int] = {}
    for j, i in reversed(windows):
        run = eng.chat(messages([a_urls[j], x_urls[i]]), max_tokens=8)
        s = run.summary
        served += s["num_reused_tokens"]
        prompt += s["num_prompt_tokens"]
        for mode, n in s["reused_tokens_by_mode"].items():
            modes[mode] = modes.get(mode, 0) + n
        x = [c for c in run.chunks if c.is_mm][-1]
        x_total += x.length
        x_served += run.num_served(x.start, x.end)
        agree += list(run.output.outputs[0].token_ids) == list(first[(j, i)].output.outputs[0].token_ids)
    return {
        "stored_nbytes": int(nbytes),
        "prompt_tokens": prompt,
        "tokens_served": served,
        "tokens_served_per_mib": round(served / (nbytes / (1 << 20)), 2) if nbytes else None,
        "x_hit_rate": round(x_served / x_total, 3) if x_total else None,
        "reused_tokens_by_mode": modes,
        "greedy_agreement": round(agree / len(windows), 3),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _lone(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


def _line(report: dict[str, Any]) -> str:
    parts = []
    for b in report["budgets"]:
        c, p = b["arms"]["conditioned"], b["arms"]["patches"]
        parts.append(f"budget {b['budget_fraction']}: conditioned {c['tokens_served_per_mib']} tokens/MiB "
                     f"(X hit {c['x_hit_rate']}), canonical+patches {p['tokens_served_per_mib']} "
                     f"(X hit {p['x_hit_rate']}): tokens served x{b['ratio_tokens_served']}, "
                     f"X tokens x{b['ratio_x_tokens_served']}, per byte x{b['ratio_tokens_served_per_byte']}")
    return "bench bytes: " + "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
