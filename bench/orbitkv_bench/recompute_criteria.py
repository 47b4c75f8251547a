"""Which tokens of a moved record should selective recompute compute? A measurement on the real
model, offline (Hugging Face forward, fp32), on ``bench fidelity``'s traces.

For every record of every question prompt whose context differs from its canonical's, the deficit of
each token is what reuse loses there: ``sum over layers of |K(r | context) - R(delta) K(r | anchor)|^2
+ |V(r | context) - V(r | anchor)|^2`` (the canonical relocated exactly, as the ``recompute`` mode
loads it). A criterion picks ``ceil(f * n)`` of the record's ``n`` tokens; the share of the record's
deficit energy the picked tokens hold is reported per criterion and budget ``f``:

- ``first``: the record's first tokens (MPIC, VLCache, EPIC; what the ``recompute`` mode serves);
- ``oracle``: the tokens with the largest deficit in this very context (CacheBlend's criterion with
  the true deviation at every layer: known only after a full prefill, an upper bound);
- ``stored``: the tokens with the largest deficit where the same record was last seen in another
  context (a per-token score stored at save time: the serve-time form of CacheBlend's criterion);
- ``uniform``: the expected share of ``ceil(f * n)`` tokens picked at random (``k / n``).

The share of deficit held is not answer fidelity (a recomputed token also changes what attends to
it), but it says whether a criterion aims at the tokens where reuse loses most.

``python -m orbitkv_bench.recompute_criteria --model smollm2 [--episodes 2] [--out F]``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from orbitkv.agent.doc_trace import make_trace, user_text
from orbitkv_bench import fidelity_arms as fa
from orbitkv_bench.fidelity import model_dir as resolve_model

CRITERIA = ("first", "stored", "oracle", "uniform")


def record_spans(
    tokenizer: Any, user: str, spans: Sequence[tuple[int, int]]
) -> tuple[list[int], list[tuple[int, int]]]:
    """(prompt token ids, each record's token span) of the chat whose user turn is ``user``."""
    messages = [{"role": "user", "content": user}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    base = prompt.index(user)
    ids, starts = fa.token_offsets(tokenizer, prompt)
    index = {c: i for i, c in enumerate(starts)}
    return ids, [(index[base + s], index[base + e]) for s, e in spans]


def kv_of(model: Any, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) as ``[T, H, D]`` (K after RoPE), of one forward over ``ids``."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    layers = range(len(cache.layers)) if hasattr(cache, "layers") else range(len(cache))
    result = []
    for i in layers:
        layer = cache.layers[i] if hasattr(cache, "layers") else None
        k, v = (layer.keys, layer.values) if layer is not None else cache[i]
        result.append((k[0].transpose(0, 1).float(), v[0].transpose(0, 1).float()))
    return result


def deficit(
    full: list[tuple[torch.Tensor, torch.Tensor]],
    canon: list[tuple[torch.Tensor, torch.Tensor]],
    begin: int,
    num_anchor: int,
    spec: Any,
) -> torch.Tensor:
    """Per token of the record at ``[begin, begin + n)``: its deficit energy over all layers."""
    from orbitkv.kernels.relocate import relocate_ref

    n = canon[0][0].shape[0] - num_anchor
    out = torch.zeros(n)
    for (k, v), (kc, vc) in zip(full, canon, strict=True):
        moved = relocate_ref(kc[num_anchor:].contiguous(), begin - num_anchor, spec)
        out += (k[begin:begin + n] - moved).square().sum((1, 2))
        out += (v[begin:begin + n] - vc[num_anchor:]).square().sum((1, 2))
    return out


def share(energy: torch.Tensor, picked: Sequence[int]) -> float:
    total = float(energy.sum())
    return float(energy[list(picked)].sum()) / total if total > 0 else 0.0


def top(scores: torch.Tensor, k: int) -> list[int]:
    return torch.topk(scores, k).indices.tolist()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from orbitkv.kernels.rope import RopeSpec
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orbitkv.serving.anchor import chat_anchor_tokens

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    spec = RopeSpec.from_hf_config(model.config)
    anchor = chat_anchor_tokens(path)
    fractions = [float(f) for f in args.fractions.split(",")]
    shares: dict[str, dict[float, list[float]]] = {c: {f: [] for f in fractions} for c in CRITERIA}
    canon_memo: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    last_seen: dict[tuple[int, int], tuple[tuple[int, ...], torch.Tensor]] = {}
    num_records = 0
    for episode in make_trace(args.seed, args.episodes, window=args.window, num_steps=args.steps):
        for step in episode.steps:
            user, spans = user_text(episode.records, step)
            ids, token_spans = record_spans(tokenizer, user, spans)
            full = kv_of(model, ids)
            for r, (begin, end) in zip(step.window, token_spans, strict=True):
                record = tuple(ids[begin:end])
                if record not in canon_memo:
                    canon_memo[record] = kv_of(model, anchor + list(record))
                energy = deficit(full, canon_memo[record], begin, len(anchor), spec)
                context = tuple(ids[:begin])
                if context == tuple(anchor):
                    continue  # the canonical's own context: nothing lost, nothing to pick
                previous = last_seen.get((episode.index, r))
                if previous is not None and previous[0] != context:
                    num_records += 1
                    n = len(record)
                    for f in fractions:
                        k = min(n, max(1, math.ceil(f * n - 1e-9)))
                        shares["first"][f].append(share(energy, range(k)))
                        shares["oracle"][f].append(share(energy, top(energy, k)))
                        shares["stored"][f].append(share(energy, top(previous[1], k)))
                        shares["uniform"][f].append(k / n)
                last_seen[(episode.index, r)] = (context, energy)
            print(f"ep {episode.index} step {step.index} {step.op}: {num_records} records",
                  file=sys.stderr, flush=True)
    return {
        "model": str(path),
        "config": {"seed": args.seed, "episodes": args.episodes, "steps": args.steps,
                   "window": args.window, "fractions": fractions},
        "num_records": num_records,
        "deficit_share": {
            c: {f"{f:g}": round(statistics.fmean(v), 4) if v else None for f, v in by_f.items()}
            for c, by_f in shares.items()
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orbitkv_bench.recompute_criteria",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--episodes", type=int, default=2)
    p.add_argument("--steps", type=int, default=11)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--fractions", default="0.05,0.15,0.3")
    p.add_argument("--out")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    doc = measure(args)
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
