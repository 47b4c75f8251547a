"""``orbitkv bench replicas``: the agent trace on several servers of the same systems, side by side.

``bench agent`` sets OrbitKV against one APC server. Two servers of one system, started alike and
bound to the same cores, differ too, request by request (their memory placement, the machine's
drift between their turns): this bench puts that noise floor beside the ratio, so that a figure
inside it reads as a tie. ``--systems orbitkv,apc,orbitkv,apc`` starts four servers (``orbitkv``,
``apc``, ``orbitkv#2``, ``apc#2``), each OrbitKV one with an empty store of its own, and runs
every episode on each in turn (the order reversed on odd episodes, each quiet before the next).
For every pair of arms it prints the ratio of their TTFT p50s, the median of the per-request
ratios (the same step of the same episode on both; client TTFT and vLLM's engine TTFT) and how
many answers agree. ``a_vs_b`` is b's time over a's: above 1, a is faster.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orbitkv.agent.arms import Arm, run_interleaved, running
from orbitkv.agent.demo import ensure_model
from orbitkv.agent.fairness import add_cores_argument, binding_env
from orbitkv.agent.workload import TRACES
from orbitkv.serving.server_process import SYSTEMS, model_server

from .agent import arm_config, build_workloads, screenshot_size


def labels(systems: Sequence[str]) -> list[str]:
    """Each arm's name: its system, with ``#k`` from the system's second server on."""
    seen: dict[str, int] = {}
    out = []
    for system in systems:
        seen[system] = seen.get(system, 0) + 1
        out.append(system if seen[system] == 1 else f"{system}#{seen[system]}")
    return out


def pair_ratios(records: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per pair of arms (in the given order), their requests matched by episode and step."""
    by_step = {
        name: {(r["episode"], r["step"]): r for r in recs if r.get("ttft_s")}
        for name, recs in records.items()
    }
    ratios: dict[str, dict[str, Any]] = {}
    for a, b in itertools.combinations(records, 2):
        common = sorted(set(by_step[a]) & set(by_step[b]))
        if not common:
            continue
        pairs = [(by_step[a][k], by_step[b][k]) for k in common]
        engine = [y["engine_ttft_s"] / x["engine_ttft_s"] for x, y in pairs
                  if x.get("engine_ttft_s") and y.get("engine_ttft_s")]
        ratios[f"{a}_vs_{b}"] = {
            "num_requests": len(common),
            "ttft_p50": statistics.median(y["ttft_s"] for _, y in pairs)
            / statistics.median(x["ttft_s"] for x, _ in pairs),
            "ttft_per_request_median": statistics.median(y["ttft_s"] / x["ttft_s"] for x, y in pairs),
            "engine_ttft_per_request_median": statistics.median(engine) if engine else None,
            "answers_equal": sum(x.get("answer") == y.get("answer") for x, y in pairs),
        }
    return ratios


def format_ratios(ratios: Mapping[str, Mapping[str, Any]]) -> str:
    lines = ["pairs (a_vs_b: b's time over a's, above 1: a is faster):"]
    for name, r in ratios.items():
        engine = r["engine_ttft_per_request_median"]
        lines.append(
            f"  {name:<22} TTFT p50 x{r['ttft_p50']:.3f}  per request x{r['ttft_per_request_median']:.3f}"
            + (f" (engine x{engine:.3f})" if engine is not None else "")
            + f"  answers {r['answers_equal']}/{r['num_requests']}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"orbitkv bench replicas: unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    names = labels(systems)
    workdir = Path(args.workdir).resolve()
    # The model where ``bench agent`` builds it (same workdir by default); stores and logs apart.
    model_dir = (Path(args.model_dir) if args.model_dir
                 else ensure_model(workdir / "models", "smolvlm", "bench", weights=True))
    own = workdir / "replicas"
    image_size, mm_kwargs = screenshot_size(json.loads((model_dir / "config.json").read_text()), "bench")
    shape = argparse.Namespace(trace=args.trace, seed=args.seed, episodes=args.episodes, window=0,
                               steps=0, obs_words=12, tool_words=12)
    workloads = build_workloads(shape, image_size)
    shutil.rmtree(own / "store", ignore_errors=True)
    env = binding_env(args.cores)
    arms = [
        Arm(system, model_server(
            model_dir, system, own / "logs" / f"{name}.log",
            extra_config=arm_config(system, own / "store" / name, model_dir),
            max_images=max(len(s.images) for w in workloads for s in w.steps), dev_mode=True,
            startup_timeout_s=args.startup_timeout, mm_processor_kwargs=mm_kwargs, env=env,
            is_logging_iterations=True, load_format="auto",
        ))
        for name, system in zip(names, systems, strict=True)
    ]
    with running(arms, workloads[0], log):
        run_interleaved(arms, workloads, log, max_tokens=args.max_tokens)
    records = {name: [r.to_json() for r in arm.records] for name, arm in zip(names, arms, strict=True)}
    return {
        "config": {"trace": args.trace, "episodes": args.episodes, "max_tokens": args.max_tokens,
                   "systems": names, "model_dir": str(model_dir), "cores": args.cores,
                   "binding_env": env},
        "errors": {name: arm.error for name, arm in zip(names, arms, strict=True) if arm.error},
        "pairs": pair_ratios(records),
        "steps": records,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="orbitkv bench replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="orbitkv,apc,orbitkv,apc",
                   help="comma-separated; a system named again is another server of it")
    p.add_argument("--trace", default="basic", choices=sorted(TRACES))
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", help="a SmolVLM model directory (default: build the bench model)")
    p.add_argument("--workdir", default=".orbitkv/bench",
                   help="the bench model is built (once) under it, the servers' stores and logs in replicas/")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--json", action="store_true", help="print the JSON on stdout (progress on stderr)")
    add_cores_argument(p)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    out = sys.stderr if args.json else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=out, flush=True)

    doc = run(args, log)
    log(format_ratios(doc["pairs"]))
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
