"""``orbitkv fidelity [--arch A ...] [--json] [--plot DIR] [--quick]``: the fidelity lab.

Multi-chunk prompts ``[BOS] A1 .. Ak B Q`` run through every reuse arm (ceiling re-prefill,
blind, relocate-only, OrbitKV patch at several ranks and deep-only, CacheBlend, VLCache, MPIC,
EPIC, MM-ShiftKV, KVCapsule), all given the same relocated KV; reports next-token KL to the
ceiling, eta, flip recovery, KV error by layer, deficit energy vs rank and bytes / tokens per arm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_ARCHES = ("qwen2", "llama", "qwen2-vl", "deepseek-v2")
ARCH_CHOICES = (*DEFAULT_ARCHES, "binding")

NOTES = [
    "Random-weight tiny models (fp32 model, bf16 cache); binding = the trained binding model.",
    "blind = canonical KV(chunk|anchor) reused at its stored positions; relocate = exact RoPE "
    "relocation; every repair arm starts from the relocated KV. eta = 1 - KL(arm)/KL(blind) "
    "(pooled over items); eta_vs_relocate uses relocate-only as the base (Kamera's reuse).",
    "Token arms run an exact partial prefill (reused rows substituted in the cache layer by layer); "
    "their extra_bytes is the byte-equivalent of the KV rows they recompute.",
    "Patch = oracle rank-m truncated SVD of the item's own deficit, bf16 factors, on every chunk "
    "that has an antecedent; patch-deep = layers L/2..L-1 only.",
    "Storage arms (KVCapsule, MM-ShiftKV) compress the conditioned KV(chunk|A..); stored_bytes is "
    "their compressed size (KVCapsule's offline parameters not counted).",
]


def _available_binding(path: str | None = None) -> bool:
    from orbitkv_lab.fidelity.lab import BINDING_DIR

    return (Path(path or BINDING_DIR) / "config.json").exists()


def run(
    arches: tuple[str, ...],
    quick: bool,
    models_dir: str | None,
    command: str,
    binding_dir: str | None = None,
) -> dict:
    from orbitkv_lab.fidelity import lab

    cfg = lab.LabConfig.quick() if quick else lab.LabConfig()
    rows, notes = [], list(NOTES)
    with tempfile.TemporaryDirectory(prefix="orbitkv-fidelity-") as tmp:
        root = Path(models_dir) if models_dir else Path(tmp)
        for arch in arches:
            if arch == "binding" and not _available_binding(binding_dir):
                notes.append(
                    f"binding: no weights in {binding_dir or 'lab/orbitkv_lab/assets/binding'}, skipped"
                )
                continue
            rows.append(lab.run_arch(arch, cfg, root, binding_dir))
    return {
        "schema": lab.SCHEMA_VERSION,
        "command": command,
        "quick": quick,
        "config": json.loads(json.dumps(dataclasses.asdict(cfg))),
        "arches": rows,
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> int:
    from orbitkv_lab.fidelity import report as rep

    parser = argparse.ArgumentParser(prog="orbitkv fidelity", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch",
        action="append",
        choices=ARCH_CHOICES,
        help="repeatable; default: the 4 tiny arches (+ binding if shipped)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", help="also write the JSON report to this file")
    parser.add_argument(
        "--from-json", metavar="FILE", help="re-render tables / plots of a saved report"
    )
    parser.add_argument("--plot", metavar="DIR", help="write PNG figures here")
    parser.add_argument("--quick", action="store_true", help="tiny settings (tests)")
    parser.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    parser.add_argument("--models-dir", help="reuse / keep the generated model directories here")
    parser.add_argument(
        "--binding-dir", help="binding model weights (default: lab/orbitkv_lab/assets/binding)"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    has_binding = _available_binding(args.binding_dir)
    arches = tuple(args.arch or (*DEFAULT_ARCHES, *(("binding",) if has_binding else ())))
    t0 = time.perf_counter()
    command = "orbitkv fidelity " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
    else:
        report = run(arches, args.quick, args.models_dir, command.strip(), args.binding_dir)
        report["seconds"] = round(time.perf_counter() - t0, 1)
    if args.plot:
        report["figures"] = rep.plots(report, args.plot)
    text = json.dumps(report, indent=1, allow_nan=True)
    if args.out:
        Path(args.out).write_text(text)
    print(text if args.json else rep.table(report, markdown=args.markdown))
    errs = rep.validate(report)
    if errs:
        print("malformed report: " + ", ".join(errs[:10]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
