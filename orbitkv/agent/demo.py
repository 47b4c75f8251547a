"""``orbitkv demo``: vLLM + OrbitKV on an agent workload, next to vLLM's prefix cache alone.

1. builds a tiny multimodal model locally (SmolVLM / Idefics3, random weights);
2. starts a vLLM OpenAI server with OrbitKV on the embedded store (memory + a local disk directory
   under ``--workdir``), drives the agent trace, stops it; then the same with vLLM's prefix cache
   (APC) alone;
3. the trace: a window of ``--window`` synthetic screenshots sliding over a stream of them, one
   reorder, one recall of an image evicted earlier, a question each step (``workload.py``);
4. prints per step the tokens reused (vLLM's prefix cache, and OrbitKV by mode) vs computed, and
   the time to first token, for both systems.

Every number is what the servers reported; a system that did not run says why.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orbitkv.agent import driver as drv
from orbitkv.agent.workload import Workload, make_workload
from orbitkv.serving.server_process import (
    ORBITKV_SYSTEMS,
    SYSTEM_TITLES,
    first_model_id,
    model_server,
)

DEMO_SYSTEMS = ("orbitkv", "apc")
MODE_ORDER = ("exact", "survivor", "patched", "blind")


def ensure_model(root: Path, arch: str = "smolvlm", size: str = "tiny") -> Path:
    """``root/<arch>-<size>``, made by ``make_model`` once and reused by later runs."""
    path = root / f"{arch}-{size}"
    if not (path / "orbitkv_model.json").exists():
        from orbitkv.models.make_model import make_model

        if path.exists():
            shutil.rmtree(path)
        make_model(path, arch, size)
    return path


def store_config(store_dir: Path, model_dir: Path | None = None) -> dict[str, Any]:
    """The embedded store (process memory + a local disk directory) and, for a chat model, its
    anchor (the chat template's user-turn prefix), so images can be canonicalized."""
    out: dict[str, Any] = {
        "local_cpu": True,
        "max_local_cpu_size": 0.5,
        "local_disk": f"file://{store_dir.resolve()}",
        "max_local_disk_size": 2.0,
    }
    if model_dir is not None:
        from orbitkv.serving.anchor import chat_anchor_tokens

        out["orbitkv"] = {"anchor_tokens": chat_anchor_tokens(model_dir)}
    return out


def run_system(
    system: str,
    model_dir: Path,
    workload: Workload,
    workdir: Path,
    *,
    max_tokens: int = 1,
    stream: bool = False,
    extra_config: dict[str, Any] | None = None,
    log: Any = None,
    startup_timeout_s: float = 600.0,
    block_size: int = 32,
) -> tuple[list[drv.StepRecord], str | None, dict[str, Any]]:
    """Start one server, warm it up, run the trace, stop it. Returns (records, error, info)."""
    log = log or (lambda msg: None)
    log_path = workdir / "logs" / f"{system}.log"
    server = model_server(
        model_dir,
        system,
        log_path,
        extra_config=extra_config if system in ORBITKV_SYSTEMS else None,
        max_images=workload.window + 1,
        block_size=block_size,
        startup_timeout_s=startup_timeout_s,
    )
    info: dict[str, Any] = {"log": str(log_path), "cmd": server.cmd}
    t0 = time.monotonic()
    log(f"[{SYSTEM_TITLES[system]}] starting vLLM server (log: {log_path}) ...")
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        return [], _first_error_line(str(exc)), info
    records: list[drv.StepRecord] = []
    try:
        info["startup_s"] = round(time.monotonic() - t0, 1)
        log(f"[{SYSTEM_TITLES[system]}] ready in {info['startup_s']} s; warm-up, then {len(workload.steps)} steps")
        model = first_model_id(server.base_url)
        drv.warm_up(server.base_url, model, workload, connector=system in ORBITKV_SYSTEMS)
        records = drv.run_trace(
            server.base_url, model, workload, max_tokens=max_tokens, stream=stream,
            register=system in ORBITKV_SYSTEMS,
            on_step=lambda r: log(f"  step {r.step} {r.kind:<8} ttft {r.ttft_s:.3f} s  computed {r.computed_tokens}"),
        )
    except Exception as exc:  # report what ran; the server log has the rest
        return records, f"{type(exc).__name__}: {exc}"[:500], info
    finally:
        server.stop()
    return records, None, info


def _first_error_line(text: str) -> str:
    """The most telling line of a failed start-up log."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ("Error" in ln or "error" in ln) and "errors.pydantic.dev" not in ln:
            return ln[:400]
    return lines[0][:400] if lines else "failed to start"


# -- presentation --------------------------------------------------------------------------------


def reused_text(rec: drv.StepRecord, system: str) -> str:
    parts = []
    if rec.apc_tokens:
        parts.append(f"apc {rec.apc_tokens}")
    if system == "orbitkv":
        modes = rec.reused_by_mode or {}
        for mode in sorted(modes, key=lambda m: (MODE_ORDER.index(m) if m in MODE_ORDER else 9, m)):
            parts.append(f"{mode} {modes[mode]}")
        unexplained = (rec.connector_tokens or 0) - sum(modes.values())
        if unexplained > 0:
            parts.append(f"connector {unexplained}")
    if rec.apc_tokens is None and rec.connector_tokens is None:
        return "?"
    return " + ".join(parts) if parts else "0"


def format_table(workload: Workload, results: dict[str, dict[str, Any]]) -> str:
    systems = [s for s in results if results[s]["records"]]
    head = ["step", "kind", "images", "prompt", "floor"]
    rows: list[list[str]] = []
    by_system = {s: {r.step: r for r in results[s]["records"]} for s in systems}
    for step in workload.steps:
        first = next((by_system[s][step.index] for s in systems if step.index in by_system[s]), None)
        prompt = None if first is None else first.prompt_tokens
        floor = None if first is None else first.floor_tokens
        row = [str(step.index), step.kind, " ".join(map(str, step.images)),
               "?" if prompt is None else str(prompt), "?" if floor is None else str(floor)]
        for s in systems:
            rec = by_system[s].get(step.index)
            if rec is None:
                row += ["-", "-", "-"]
            else:
                row += [reused_text(rec, s), str(rec.computed_tokens), f"{rec.ttft_s * 1000:.0f}"]
        rows.append(row)
    total = ["all", "", "", "", str(results[systems[0]]["summary"].get("floor_tokens") or "?")]
    for s in systems:
        summ = results[s]["summary"]
        reused = sum(v for v in summ["reused_tokens_by_mode"].values())
        total += [f"{reused} reused", str(summ["prefill_tokens_computed"]), f"p50 {summ['ttft_p50_s'] * 1000:.0f}"]
    rows.append(total)
    sub = [""] * len(head)
    sub += ["reused (source/mode)", "computed", "TTFT ms"] * len(systems)
    widths = [max(len(r[i]) for r in [head + [""] * (len(sub) - len(head)), sub] + rows) for i in range(len(sub))]
    group = ""
    for i, h in enumerate(head):
        group += h.ljust(widths[i]) + "  "
    col = len(head)
    for s in systems:
        w = sum(widths[col : col + 3]) + 4
        group += "| " + SYSTEM_TITLES[s].ljust(w) + "  "
        col += 3
    lines = [group.rstrip()]

    def fmt(row: list[str]) -> str:
        out = ""
        for i, cell in enumerate(row):
            if i >= len(head) and (i - len(head)) % 3 == 0:
                out += "| "
            numeric = i >= len(head) and (i - len(head)) % 3 != 0 or i in (3, 4)
            out += (cell.rjust(widths[i]) if numeric else cell.ljust(widths[i])) + "  "
        return out.rstrip()

    lines.append(fmt(sub))
    lines.append("-" * len(lines[-1]))
    lines += [fmt(r) for r in rows[:-1]]
    lines.append("-" * len(lines[1]))
    lines.append(fmt(rows[-1]))
    return "\n".join(lines)


def total_line(summ: dict[str, Any]) -> str:
    """One system's totals: computed vs prompt tokens, reuse by source and mode, TTFT."""
    modes = dict(summ["reused_tokens_by_mode"])
    apc = modes.pop("apc_prefix", 0)
    parts = [f"apc {apc}"]
    if modes or summ.get("connector_tokens"):
        split = ", ".join(f"{m} {n}" for m, n in modes.items())
        parts.append(f"orbitkv {summ.get('connector_tokens') or 0}" + (f": {split}" if split else ""))
    engine = summ.get("engine_ttft_p50_s")
    engine_text = f" (engine {engine * 1000:.0f} ms)" if engine is not None else ""
    return (
        f"computed {summ['prefill_tokens_computed']} of {summ['prompt_tokens']} prompt tokens "
        f"(reused: {'; '.join(parts)}); TTFT p50 {summ['ttft_p50_s'] * 1000:.0f} ms{engine_text}"
    )


def explain(workload: Workload, results: dict[str, dict[str, Any]]) -> list[str]:
    notes = ["", "trace:"]
    for step in workload.steps:
        notes.append(f"  step {step.index} {step.kind:<8} {step.note}; question: {step.question!r}")
    notes += ["", f"totals over {len(workload.steps)} steps:"]
    for system, res in results.items():
        if res["records"]:
            notes.append(f"  {SYSTEM_TITLES[system]:<9} " + total_line(res["summary"]))
    notes.append("")
    notes.append("reused: 'apc' = vLLM's own prefix cache (a prompt prefix identical to an earlier one);")
    notes.append("        exact/survivor/patched/blind = KV chunks OrbitKV loaded from its store (design.md).")
    notes.append("floor: tokens no cache could avoid (the step's new images and observations, its tool output,")
    notes.append("       its question), counted with the server's /tokenize.")
    notes.append("TTFT: client-side time to first token, max_tokens=1; 'computed' = tokens prefilled by the model;")
    notes.append("      engine = vLLM's own time from scheduling to the first token, per request.")
    for system, res in results.items():
        title = SYSTEM_TITLES[system]
        if res.get("error"):
            notes.append(f"{title}: did not complete: {res['error']}")
            notes.append(f"  server log: {res['info'].get('log')}")
        elif system == "orbitkv":
            summ = res["summary"]
            if not summ.get("connector_tokens"):
                notes.append(f"{title}: the connector served no tokens in this run (everything it did not compute "
                             "came from vLLM's prefix cache).")
            if res["records"] and all(r.orbitkv is None for r in res["records"]):
                notes.append(f"{title}: no per-request OrbitKV summary came back in kv_transfer_params.")
    return notes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="orbitkv demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=".orbitkv/demo", help="model, store and logs (default .orbitkv/demo)")
    p.add_argument("--window", type=int, default=3, help="images in the window (K)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--obs-words", type=int, default=8, help="words of observation after each image")
    p.add_argument("--tool-words", type=int, default=8,
                   help="words of fresh tool output per step, before the window's last image")
    p.add_argument("--systems", default=",".join(DEMO_SYSTEMS), help="comma list of orbitkv,apc,none")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--stream", action="store_true",
                   help="time the first streamed chunk (vLLM then returns no kv_transfer_params: no by-mode split)")
    p.add_argument("--keep-store", action="store_true", help="keep the OrbitKV store from an earlier run")
    p.add_argument("--model-dir", help="use this model directory instead of building one")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="also write results as JSON (to PATH or stdout)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    result = run_demo(args)
    return 0 if all(not r.get("error") for r in result["systems"].values()) else 1


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    quiet_json = args.json == "-"
    out = sys.stderr if quiet_json else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=out, flush=True)

    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    workload = make_workload(seed=args.seed, window=args.window, num_steps=args.steps,
                             obs_words=args.obs_words, tool_words=args.tool_words)
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        log(f"building the tiny SmolVLM model in {workdir / 'models'} ...")
        model_dir = ensure_model(workdir / "models")
    store_dir = workdir / "store"
    if store_dir.exists() and not args.keep_store:
        shutil.rmtree(store_dir)
    results: dict[str, dict[str, Any]] = {}
    for system in systems:
        records, error, info = run_system(
            system, model_dir, workload, workdir, max_tokens=args.max_tokens, stream=args.stream,
            extra_config=store_config(store_dir / system, model_dir), log=log,
            startup_timeout_s=args.startup_timeout,
        )
        results[system] = {"records": records, "error": error, "info": info,
                           "summary": drv.summarize(system, records, error).to_json()}
        if error:
            log(f"[{SYSTEM_TITLES[system]}] FAILED: {error}")
    log("")
    if any(r["records"] for r in results.values()):
        log(format_table(workload, results))
    for line in explain(workload, results):
        log(line)
    doc = {
        "workload": {"seed": workload.seed, "window": workload.window, "steps": workload.describe()},
        "model_dir": str(model_dir),
        "store_dir": str(store_dir),
        "systems": {
            s: {"error": r["error"], "summary": r["summary"], "info": r["info"],
                "steps": [rec.to_json() for rec in r["records"]]}
            for s, r in results.items()
        },
    }
    if args.json:
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
