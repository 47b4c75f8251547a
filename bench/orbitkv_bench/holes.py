"""``orbitkv bench holes [--json]``: a hole's cost next to the same tokens loaded as a prefix.

Two prompts of the same shape, side by side in one in-process engine (``bench``-size qwen2, vLLM's
dummy weights: timing only): ``sys . t1 . c1 . t2 . c2 . q`` where t1, t2 are fresh and c1, c2
cached, so c1 and c2 are holes (three forward steps), and ``sys . c1 . c2 . t1 . t2 . q`` where the
same number of cached tokens is one prefix run (one forward step). Both load 1280 tokens and compute
528; a full prefill of the first is the third column. Medians of ``--repeats`` runs, each on fresh
segments, after one warm-up.

The three arms share one engine and so its threads; they alternate within each repeat (holes,
prefix, full prefill), each ratio comes with its per-repeat spread, and the threads and cores each
arm ran on are read back before it runs (``threads``): an in-process engine gets no OpenMP binding
from vLLM (its uniprocess executor sets none), so its compute threads are torch's, on every core
this process may use.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SHAPE = (256, 256, 512, 256, 512, 16)  # sys, t1, c1, t2, c2, q (tokens)


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from orbitkv.store.keys import conditioned_key
    from vllm import SamplingParams

    from orbitkv.agent.fairness import allowed_cores, spread
    from orbitkv.checks.engine import OFF, orbitkv_llm
    from orbitkv.models.make_model import make_model

    model_dir = make_model(Path(args.workdir) / "qwen2-bench", "qwen2", "bench", weights=False)
    extra = {"chunk_size": 256, "max_local_cpu_size": 2, "orbitkv_text_chunking": "fixed"}
    exact = {"orbitkv": {"modes": ["exact"]}}

    def segments(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(10, 1000, (n,), generator=g).tolist() for n in SHAPE]

    with orbitkv_llm(str(model_dir), extra, load_format="dummy", max_model_len=4096,
                     max_num_batched_tokens=4096, kv_cache_gb="4") as llm:
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        finished: dict[str, list] = {}
        inner = connector.scheduler.request_finished

        def record(request: Any, block_ids: Any) -> Any:
            finished[request.request_id] = list(connector.scheduler._reqs[request.request_id].chunks)
            return inner(request, block_ids)

        connector.scheduler.request_finished = record

        threads: dict[str, set[tuple[int, tuple[int, ...]]]] = {"holes": set(), "prefix": set(), "full_prefill": set()}

        def read_threads(arm: str) -> None:
            threads[arm].add((torch.get_num_threads(), tuple(allowed_cores())))

        def timed(ids: list[int], params: dict | None) -> tuple[float, dict]:
            assert llm.reset_prefix_cache()
            extra_args = {"kv_transfer_params": params} if params else None
            sp = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra_args)
            started = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
            return time.perf_counter() - started, (out.kv_transfer_params or {}).get("orbitkv", {})

        def cached_except(ids: list[int], fresh_starts: set[int]) -> None:
            """Run once (every chunk saved), then forget the chunks starting at ``fresh_starts``."""
            before = set(finished)
            timed(ids, None)
            (req_id,) = set(finished) - before
            connector.writer.flush()
            connector.store.flush()
            connector.store.delete([conditioned_key(c.cid, c.antecedent_hash)
                                    for c in finished[req_id] if c.start in fresh_starts])

        times: dict[str, list[float]] = {"holes": [], "prefix": [], "full_prefill": []}
        summaries: dict[str, dict] = {}
        for rep in range(args.repeats + 1):
            sys_, t1, c1, t2, c2, q = segments(100 * rep)
            holes = sys_ + t1 + c1 + t2 + c2 + q
            cached_except(holes, {256, 1024})
            read_threads("holes")
            t_holes, summaries["holes"] = timed(holes, exact)
            sys_, t1, c1, t2, c2, q = segments(100 * rep + 50)
            prefix = sys_ + c1 + c2 + t1 + t2 + q
            cached_except(prefix, {1280, 1536})
            read_threads("prefix")
            t_prefix, summaries["prefix"] = timed(prefix, exact)
            read_threads("full_prefill")
            t_full, _ = timed(holes, OFF)
            if rep:  # the first round warms the engine up
                times["holes"].append(t_holes)
                times["prefix"].append(t_prefix)
                times["full_prefill"].append(t_full)
    medians = {k: statistics.median(v) for k, v in times.items()}
    seen = {arm: [{"torch_threads": n, "cores": list(cores)} for n, cores in sorted(v)] for arm, v in threads.items()}
    is_equal = len({json.dumps(v) for v in seen.values()}) == 1 and all(len(v) == 1 for v in seen.values())
    if not is_equal:
        return {"error": f"the arms ran on different threads or cores: {seen}", "threads": seen}
    return {
        "model": "qwen2-bench (16 layers, hidden 1024, dummy weights)",
        "prompt_tokens": sum(SHAPE),
        "median_s": {k: round(v, 4) for k, v in medians.items()},
        "holes_over_prefix": round(medians["holes"] / medians["prefix"], 3),
        "full_prefill_over_holes": round(medians["full_prefill"] / medians["holes"], 3),
        "holes_over_prefix_spread": spread([h / p for h, p in zip(times["holes"], times["prefix"], strict=True)]),
        "full_prefill_over_holes_spread": spread(
            [f / h for f, h in zip(times["full_prefill"], times["holes"], strict=True)]),
        "order": "per repeat: holes, prefix, full prefill, in one engine",
        "threads": seen,
        "served": {k: {f: s.get(f) for f in ("reused_tokens_by_mode", "num_hole_tokens")}
                   for k, s in summaries.items()},
        "repeats": args.repeats,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="orbitkv bench holes", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the JSON on stdout")
    p.add_argument("--out", help="also write the JSON to this file (vLLM logs to stdout too)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=".orbitkv/bench-holes")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    doc = run(args)
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if "error" in doc:
        print(text if args.json else f"no ratios: {doc['error']}")
        return 1
    print(text if args.json else
          f"holes {doc['median_s']['holes']} s, same tokens as a prefix {doc['median_s']['prefix']} s, "
          f"full prefill {doc['median_s']['full_prefill']} s (x{doc['holes_over_prefix']} of the prefix)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
