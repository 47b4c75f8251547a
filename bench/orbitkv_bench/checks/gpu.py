"""``orbitkv check gpu [--json] [--device auto|cuda|cpu] [--parts kernels,memcpy,server]``: one
command for a CUDA machine.

- ``kernels`` (``gpu_kernels``): the Triton relocate, patch, paged load and gather kernels against
  their torch references, max/mean ULP of the cache dtype (fp32, bf16, fp16) per kernel and paged
  layout, against a dtype-derived tolerance;
- ``memcpy`` (``gpu_memcpy``): the fused load against a device-to-device memcpy of the same bytes
  (goal >= 0.8), CUDA events, median and spread over repeats;
- ``server`` (``gpu_server``): a live vLLM server with OrbitKV, holes, model runner V2 and async
  scheduling against a server with no connector and no prefix cache (needs vLLM; skipped with
  its reason without it, the other parts never import it).

Without CUDA (``--device auto``, the default) it runs nothing, prints ``{"ok": null, "skipped":
..., "would_check": [...]}`` and exits 0. ``--device cpu`` runs the same code on CPU tensors to
check it: the Triton kernels under ``TRITON_INTERPRET=1`` on small shapes, the memcpy comparison
on the CPU (not a GPU figure), the servers on vLLM's CPU platform (V1, no async scheduling). Every
figure says which it is. Exit status 1 when a part that ran failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

PARTS = ("kernels", "memcpy", "server")
_TRITON_MODULES = ("orbitkv.kernels.relocate_triton", "orbitkv.kernels.patch_triton",
                   "orbitkv.kernels.paged_triton")


def would_check() -> list[str]:
    """What the command checks on a CUDA machine, one line per case."""
    from orbitkv_bench.checks import gpu_kernels, gpu_memcpy, gpu_server

    return ([f"kernels: {c.describe()}" for c in gpu_kernels.cases(gpu_kernels.GPU_SIZES)]
            + [f"memcpy: {line}" for line in gpu_memcpy.describe(gpu_memcpy.GPU_PLAN)]
            + [f"server: {line}" for line in gpu_server.describe(True)])


def skipped(reason: str) -> dict[str, Any]:
    return {"check": "gpu", "ok": None, "skipped": reason, "would_check": would_check()}


def set_triton_mode(device: torch.device) -> str:
    """Compiled Triton on CUDA, the interpreter on the CPU. The flag is read when a kernel is
    defined, so a kernel module imported in the other mode cannot be switched."""
    want = "1" if device.type == "cpu" else None
    if os.environ.get("TRITON_INTERPRET") != want:
        loaded = [m for m in _TRITON_MODULES if m in sys.modules]
        if loaded:
            raise RuntimeError(
                f"the Triton kernels were already defined with TRITON_INTERPRET="
                f"{os.environ.get('TRITON_INTERPRET')!r} in this process ({', '.join(loaded)}); "
                "run the check in a fresh process")
        if want is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = want
    return "interpreter (TRITON_INTERPRET=1)" if want else "compiled"


def run(args: argparse.Namespace, device: torch.device, log) -> dict[str, Any]:
    from orbitkv_bench.checks import gpu_kernels, gpu_memcpy, gpu_server

    is_cuda = device.type == "cuda"
    started = time.perf_counter()
    doc: dict[str, Any] = {
        "check": "gpu",
        "ok": None,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if is_cuda else "cpu",
        "is_gpu_figure": is_cuda,
        "versions": _versions(gpu_server.vllm_version()),
        "parts": {},
        "skipped_parts": {},
    }
    triton_mode = set_triton_mode(device)
    if "kernels" in args.parts:
        log(f"check gpu: kernels ({triton_mode})")
        sizes = gpu_kernels.GPU_SIZES if is_cuda else gpu_kernels.CPU_SIZES
        rows = list(gpu_kernels.run_cases(gpu_kernels.cases(sizes), device))
        doc["parts"]["kernels"] = {"ok": all(r["ok"] for r in rows), "triton": triton_mode,
                                   "reference": "the *_ref torch functions on the CPU",
                                   "rows": rows}
    if "memcpy" in args.parts:
        log("check gpu: fused load vs memcpy")
        plan = gpu_memcpy.GPU_PLAN if is_cuda else gpu_memcpy.CPU_PLAN
        if args.reps:
            plan = dataclasses.replace(plan, reps=args.reps)
        doc["parts"]["memcpy"] = gpu_memcpy.run(device, plan)
    if "server" in args.parts:
        reason = gpu_server.vllm_missing()
        if reason is not None:
            doc["skipped_parts"]["server"] = reason
        else:
            log("check gpu: live servers")
            try:
                doc["parts"]["server"] = gpu_server.run(
                    is_cuda, Path(args.workdir), logprob_atol=args.logprob_atol,
                    enforce_eager=args.enforce_eager, log=log)
            except (RuntimeError, TimeoutError, OSError, AssertionError) as exc:
                doc["parts"]["server"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    results = [p["ok"] for p in doc["parts"].values()]
    doc["ok"] = False if False in results else (True if True in results else None)
    doc["seconds"] = round(time.perf_counter() - started, 1)
    return doc


def _versions(vllm: str | None) -> dict[str, Any]:
    import importlib.metadata

    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton, "vllm": vllm}


def format_summary(doc: dict[str, Any]) -> str:
    if doc.get("skipped"):
        return f"check gpu skipped: {doc['skipped']} ({len(doc['would_check'])} checks listed)"
    where = "GPU" if doc["is_gpu_figure"] else "CPU: not a GPU figure"
    lines = [f"check gpu on {doc['device_name']} ({where}): ok={doc['ok']}"]
    kernels = doc["parts"].get("kernels")
    if kernels:
        for r in kernels["rows"]:
            lines.append(f"  {r['kernel']:<12} {r['layout'] or '-':<11} {r['dtype']:<8} "
                         + (f"error {r['error']}" if "error" in r else
                            f"max {r['max_ulp']:>7} mean {r['mean_ulp']:>8} tol {r['tol_ulp']:>7} ")
                         + f"{'ok' if r['ok'] else 'FAIL'}  {r['case']}")
    memcpy = doc["parts"].get("memcpy")
    if memcpy:
        for r in memcpy["rows"]:
            ratio = r.get("ratio", r.get("error"))
            lines.append(f"  load {r['layout']:<6} {r['tokens']:>5} tok rank {r['rank']:>3} "
                         f"{r['timing']}: ratio {ratio} {r.get('ratio_spread', '')}")
    server = doc["parts"].get("server")
    if server:
        lines.append(f"  server: ok={server['ok']} holes {server.get('holes_served')}/"
                     f"{server.get('holes_expected')} refused={server.get('holes_refused')} "
                     f"{server.get('error', '')}")
    for part, reason in doc["skipped_parts"].items():
        lines.append(f"  {part}: skipped ({reason})")
    return "\n".join(lines)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="orbitkv check gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA, else skip) | cuda[:N] | cpu (checks this code, not the GPU)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {PARTS}")
    p.add_argument("--reps", type=int, help="memcpy repeats (default 20 on CUDA, 3 on the CPU)")
    p.add_argument("--logprob-atol", type=float, default=0.0,
                   help="allowed |logprob difference| between the servers (default 0: bit-equal)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="servers without CUDA graphs or torch.compile (always on the CPU)")
    p.add_argument("--workdir", default=".orbitkv/check-gpu")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown part(s) {sorted(unknown)}; choose from {PARTS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    out = sys.stderr if args.json else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=out, flush=True)

    if args.device == "cpu":
        doc = run(args, torch.device("cpu"), log)
    elif not torch.cuda.is_available():
        build = (f"built for CUDA {torch.version.cuda}" if torch.version.cuda
                 else "a build without CUDA")
        doc = skipped(f"no CUDA device: torch.cuda.is_available() is False (torch "
                      f"{torch.__version__}, {build})")
    else:
        doc = run(args, torch.device("cuda" if args.device == "auto" else args.device), log)
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text if args.json else format_summary(doc))
    return 1 if doc["ok"] is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
