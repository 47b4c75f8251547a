"""``orbitkv check batch-variance --json``: does vLLM compute a token's KV the same whatever the
length of the step that computes it?

OrbitKV's served KV is bit-exact (``check exactness``). The tokens vLLM computes after a cache hit,
though, are computed in a shorter step than a full prefill would use, and vLLM's kernels need not
give the same bits for a different number of query tokens (batch invariance). This probe runs
prompts of ``--cached`` + ``tail`` random token ids through vLLM alone (OrbitKV off): a full
prefill (vLLM's prefix cache emptied) against the same prompt with its first ``--cached`` tokens
a hit in vLLM's own prefix cache, so the step computes only ``tail`` tokens; and counts the trials
whose KV differs anywhere. Nonzero means no cache, vLLM's own included, can reproduce a full
prefill's bits for tokens computed in steps of that length on this machine and model.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="orbitkv check batch-variance", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/orbitkv-batch-variance"))
    p.add_argument("--size", default="tiny", choices=("tiny", "bench"), help="make-model SmolVLM size")
    p.add_argument("--cached", type=int, default=352, help="tokens hit in vLLM's prefix cache (block multiple)")
    p.add_argument("--tails", default="1,2,3,4,8,16,33")
    p.add_argument("--trials", type=int, default=6)
    args = p.parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text if args.json else json.dumps(report["differing_trials_by_tail"]))
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    from orbitkv.checks.engine import OFF, InProcessEngine, orbitkv_llm
    from orbitkv.models.make_model import make_model, width_scaled_std

    model_dir = make_model(args.workdir / f"smolvlm-{args.size}", "smolvlm", args.size, weights=True,
                           init_std=width_scaled_std(args.size))
    vocab = json.loads((model_dir / "config.json").read_text())["text_config"]["vocab_size"]
    tails = [int(t) for t in args.tails.split(",")]
    differing: dict[str, int] = {}
    with orbitkv_llm(model_dir, {"chunk_size": 64, "max_local_cpu_size": 0.01},
                     max_model_len=args.cached + max(tails) + 16) as llm:
        eng = InProcessEngine(llm, block_size=32)
        for tail in tails:
            num = 0
            for seed in range(args.trials):
                rng = random.Random(seed)
                ids = [rng.randrange(100, vocab) for _ in range(args.cached + tail)]
                full = eng.generate(ids, OFF)  # the prefix cache emptied first: a full prefill
                want = _kv(eng, full.block_ids, len(ids))
                hit = _generate_keeping_cache(eng, ids, OFF)
                num += any(not torch.equal(a, b) for a, b in zip(_kv(eng, hit, len(ids)), want, strict=True))
            differing[str(tail)] = num
    return {
        "model": f"smolvlm {args.size} (seeded)",
        "cached_tokens": args.cached,
        "trials": args.trials,
        "differing_trials_by_tail": differing,
        "meaning": "trials whose KV (any layer, K or V) differs between a full prefill and the same "
        "prompt computed as a prefix-cache hit plus `tail` tokens, vLLM alone",
    }


def _generate_keeping_cache(eng: Any, ids: list[int], params: dict) -> list[int]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": params})
    before = set(eng._finished)
    eng.llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    (req_id,) = set(eng._finished) - before
    return eng._finished.pop(req_id)[0]


def _kv(eng: Any, block_ids: list[int], n: int) -> list[torch.Tensor]:
    out = []
    for layer in range(eng.num_layers):
        k, v = eng.kv(block_ids, 0, n, layer)
        out += [k, v]
    return out


if __name__ == "__main__":
    sys.exit(main())
