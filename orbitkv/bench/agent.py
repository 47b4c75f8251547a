"""``orbitkv bench agent [--json]``: the agent trace on three systems, side by side in one run.

Systems (one vLLM server each, started in turn on the same model and trace):

- ``orbitkv``: vLLM's prefix cache + OrbitKV (embedded store: memory + a disk directory);
- ``apc``: vLLM's prefix cache (automatic prefix caching) alone;
- ``none``: no cache.

The model is a random-weight SmolVLM (Idefics3) at ``make_model``'s ``bench`` size (16 layers,
hidden 1024), where prefill dominates the time to first token. The trace is ``workload.py``'s:
a window of images sliding, one reorder, one recall, a question each step; ``--episodes`` runs it
again with other images (other seeds) on the same server, for more samples.

Per system: ``ttft_p50_s``, ``ttft_p95_s``, ``prefill_tokens_computed``, ``reused_tokens_by_mode``
(``apc_prefix`` = vLLM's own prefix cache; the rest is OrbitKV's per-mode report). Per pair: the
speedup ratios (TTFT p50 / p95 of the slower over the faster, and prefill tokens).

The floor, on the OrbitKV server: the last request replayed with vLLM's prefix cache emptied, so
every chunk OrbitKV stored is loaded (``all_cached``), against the prefill of only the tokens that
replay still computed (``new_tokens_only``: that many token ids, connector off) and the full
prefill of the same request (``full_prefill``: connector off, prefix cache emptied).
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
from orbitkv.agent.demo import _first_error_line, ensure_model, store_config
from orbitkv.agent.workload import Workload, chat_body, make_workload
from orbitkv.serving.server_process import (
    ORBITKV_SYSTEMS,
    SYSTEM_TITLES,
    SYSTEMS,
    first_model_id,
    model_server,
    reset_prefix_cache,
)

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


def measure_floor(base_url: str, model: str, workload: Workload, repeats: int = 3) -> dict[str, Any]:
    """All-chunks-cached TTFT vs prefill of only the new tokens vs full prefill (see module doc)."""
    step = workload.steps[-1]
    all_cached: list[drv.StepRecord] = []
    full: list[drv.StepRecord] = []
    for _ in range(repeats):
        if not reset_prefix_cache(base_url):
            raise RuntimeError("POST /reset_prefix_cache failed (server not in dev mode?)")
        all_cached.append(drv.send_step(base_url, chat_body(workload, step, model), step))
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
            "computed_tokens": last.computed_tokens,
            "connector_tokens": last.connector_tokens,
            "reused_tokens_by_mode": last.reused_by_mode,
        },
        "new_tokens_only": {
            "ttft_s": statistics.median(r["ttft_s"] for r in new_only),
            "prompt_tokens": new_only[-1]["prompt_tokens"],
        },
        "full_prefill": {
            "ttft_s": statistics.median(r.ttft_s for r in full),
            "computed_tokens": full[-1].computed_tokens,
        },
        "repeats": repeats,
    }
    out["all_cached_over_new_tokens_only"] = drv.ratio(out["all_cached"]["ttft_s"], out["new_tokens_only"]["ttft_s"])
    out["full_prefill_over_all_cached"] = drv.ratio(out["full_prefill"]["ttft_s"], out["all_cached"]["ttft_s"])
    return out


def run_bench_system(
    system: str,
    model_dir: Path,
    workloads: list[Workload],
    workdir: Path,
    *,
    extra_config: dict[str, Any] | None,
    floor: bool,
    max_tokens: int,
    log: Any,
    startup_timeout_s: float,
    mm_processor_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    log_path = workdir / "logs" / f"{system}.log"
    server = model_server(
        model_dir, system, log_path,
        extra_config=extra_config if system in ORBITKV_SYSTEMS else None,
        max_images=max(w.window for w in workloads) + 1,
        dev_mode=True,
        startup_timeout_s=startup_timeout_s,
        mm_processor_kwargs=mm_processor_kwargs,
    )  # fmt: skip
    res: dict[str, Any] = {"log": str(log_path), "records": [], "error": None, "floor": None}
    t0 = time.monotonic()
    log(f"[{SYSTEM_TITLES[system]}] starting vLLM server (log: {log_path}) ...")
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        res["error"] = _first_error_line(str(exc))
        log(f"[{SYSTEM_TITLES[system]}] FAILED to start: {res['error']}")
        return res
    try:
        res["startup_s"] = round(time.monotonic() - t0, 1)
        model = first_model_id(server.base_url)
        drv.warm_up(server.base_url, model, workloads[0], connector=system in ORBITKV_SYSTEMS)
        for episode, w in enumerate(workloads):
            res["records"] += drv.run_trace(
                server.base_url, model, w, max_tokens=max_tokens, episode=episode,
                register=system == "orbitkv_patched",
                on_step=lambda r: log(
                    f"  [{system}] ep {r.episode} step {r.step} {r.kind:<8} ttft {r.ttft_s:.3f} s "
                    f"computed {r.computed_tokens}/{r.prompt_tokens}"),
            )  # fmt: skip
        if floor and system == "orbitkv":
            log(f"  [{system}] floor: all-cached replay vs new tokens only vs full prefill")
            res["floor"] = measure_floor(server.base_url, model, workloads[-1])
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:500]
        log(f"[{SYSTEM_TITLES[system]}] FAILED: {res['error']}")
    finally:
        server.stop()
    return res


def speedups(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """For each pair (fast, slow) in SYSTEMS order: slow / fast for TTFT p50, p95 and prefill tokens."""
    out = {}
    names = [s for s in SYSTEMS if s in summaries and not summaries[s].get("error")]
    for i, fast in enumerate(names):
        for slow in names[i + 1 :]:
            a, b = summaries[fast], summaries[slow]
            out[f"{fast}_vs_{slow}"] = {
                "ttft_p50": drv.ratio(b["ttft_p50_s"], a["ttft_p50_s"]),
                "ttft_p95": drv.ratio(b["ttft_p95_s"], a["ttft_p95_s"]),
                "prefill_tokens_computed": drv.ratio(b["prefill_tokens_computed"], a["prefill_tokens_computed"]),
            }
    return out


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def format_report(doc: dict[str, Any]) -> str:
    lines = [
        f"model: {doc['config']['model']}  trace: window {doc['config']['window']}, "
        f"{doc['config']['steps']} steps x {doc['config']['episodes']} episodes",
        "",
        f"{'system':<10} {'ttft_p50_s':>10} {'ttft_p95_s':>10} {'prefill_computed':>16} {'prompt':>7}  reused_tokens_by_mode",
    ]
    for name, s in doc["systems"].items():
        if s.get("error") and not s.get("num_requests"):
            lines.append(f"{name:<10} FAILED: {s['error']}")
            continue
        modes = ", ".join(f"{k} {v}" for k, v in s["reused_tokens_by_mode"].items()) or "-"
        lines.append(
            f"{name:<10} {_fmt(s['ttft_p50_s']):>10} {_fmt(s['ttft_p95_s']):>10} "
            f"{_fmt(s['prefill_tokens_computed'], 'd'):>16} {_fmt(s['prompt_tokens'], 'd'):>7}  {modes}"
        )
        if s.get("error"):
            lines.append(f"{'':<10} (incomplete: {s['error']})")
    lines += ["", "prefill tokens computed / floor (new images, observations, tool output, question), per step kind:"]
    for name, s in doc["systems"].items():
        kinds = s.get("by_kind") or {}
        cells = [f"{k} {v['computed_tokens']}/{v['floor_tokens']} = x{_fmt(v['computed_over_floor'], '.2f')}"
                 for k, v in kinds.items()]
        lines.append(f"  {name:<16} " + ("; ".join(cells) or "-"))
    if doc["speedup"]:
        lines += ["", "speedup (slower / faster):"]
        for pair, r in doc["speedup"].items():
            lines.append(
                f"  {pair:<16} ttft_p50 x{_fmt(r['ttft_p50'], '.2f')}  ttft_p95 x{_fmt(r['ttft_p95'], '.2f')}  "
                f"prefill tokens x{_fmt(r['prefill_tokens_computed'], '.2f')}"
            )
    f = doc.get("floor")
    if f:
        lines += [
            "",
            f"floor (step {f['step']} {f['kind']}, {f['prompt_tokens']} prompt tokens, median of {f['repeats']}):",
            f"  all chunks cached (OrbitKV, APC emptied): ttft {_fmt(f['all_cached']['ttft_s'])} s, "
            f"computed {f['all_cached']['computed_tokens']}, loaded {f['all_cached']['connector_tokens']} "
            f"{f['all_cached']['reused_tokens_by_mode'] or ''}",
            f"  prefill of the new tokens only:          ttft {_fmt(f['new_tokens_only']['ttft_s'])} s "
            f"({f['new_tokens_only']['prompt_tokens']} tokens)",
            f"  full prefill, no cache:                  ttft {_fmt(f['full_prefill']['ttft_s'])} s "
            f"(computed {f['full_prefill']['computed_tokens']})",
        ]
    return "\n".join(lines)


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
        model_dir = ensure_model(workdir / "models", "smolvlm", args.size)
    cfg = json.loads((model_dir / "config.json").read_text())
    tile = (cfg.get("vision_config") or {}).get("image_size", 64)
    image_size = args.image_px or (2 * tile if args.size == "bench" else tile)
    # Images larger than the vision tower's tile are split into tiles plus a global view (Idefics3
    # image splitting): a 2x2-tile image is 5 x image_seq_len tokens, a few hundred at bench size.
    mm_kwargs = {"do_image_splitting": True, "size": {"longest_edge": image_size}} if image_size > tile else None
    workloads = [
        make_workload(seed=args.seed + e, window=args.window, num_steps=args.steps,
                      image_size=image_size, obs_words=args.obs_words, tool_words=args.tool_words)
        for e in range(args.episodes)
    ]  # fmt: skip
    if (workdir / "store").exists():
        shutil.rmtree(workdir / "store")
    raw: dict[str, dict[str, Any]] = {}
    for system in systems:
        # Each system starts from an empty store of its own: nothing carries over between arms.
        raw[system] = run_bench_system(
            system, model_dir, workloads, workdir,
            extra_config=store_config(workdir / "store" / system, model_dir),
            floor=not args.no_floor, max_tokens=args.max_tokens, log=log,
            startup_timeout_s=args.startup_timeout, mm_processor_kwargs=mm_kwargs,
        )  # fmt: skip
    summaries = {s: drv.summarize(s, r["records"], r["error"]).to_json() for s, r in raw.items()}
    text = cfg.get("text_config") or {}
    doc = {
        "config": {
            "model": f"smolvlm-{args.size} ({text.get('num_hidden_layers')} layers, hidden {text.get('hidden_size')}, "
            f"images {image_size}px{', split into tiles' if mm_kwargs else ''})",
            "model_dir": str(model_dir),
            "window": args.window,
            "steps": args.steps,
            "episodes": args.episodes,
            "obs_words": args.obs_words,
            "tool_words": args.tool_words,
            "image_px": image_size,
            "mm_processor_kwargs": mm_kwargs,
            "max_tokens": args.max_tokens,
            "ttft": "client-side, non-streaming max_tokens=1 request: response time = time to the first token",
        },
        "systems": summaries,
        "speedup": speedups(summaries),
        "floor": (raw.get("orbitkv") or {}).get("floor"),
        "steps": {s: [rec.to_json() for rec in r["records"]] for s, r in raw.items()},
        "logs": {s: r["log"] for s, r in raw.items()},
    }
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="orbitkv bench agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout (progress on stderr)")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--size", default="bench", choices=("tiny", "bench"), help="make_model size (default bench)")
    p.add_argument("--model-dir", help="use this SmolVLM model directory instead of building one")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--window", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--episodes", type=int, default=1, help="the trace again with other images, same server")
    p.add_argument("--obs-words", type=int, default=12, help="words of text observation after each image")
    p.add_argument("--tool-words", type=int, default=12,
                   help="words of fresh tool output per step, before the window's last image")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-px", type=int, default=0,
                   help="screenshot size (default: 2x the vision tile at bench size, i.e. 2x2 tiles + global)")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--workdir", default=".orbitkv/bench")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    out = sys.stderr if args.json else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=out, flush=True)

    doc = run_bench(args, log)
    log("")
    log(format_report(doc))
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
    return 0 if not any(s.get("error") for s in doc["systems"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
