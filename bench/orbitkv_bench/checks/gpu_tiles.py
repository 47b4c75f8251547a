"""``python -m orbitkv_bench.checks.gpu_tiles [--json] [--out FILE] [--device cuda|cpu]``: the fused
load's tiling and rotation paths against device memcpy, and where an eager call's time goes.

A sweep for a lent GPU, beside ``orbitkv check gpu``'s memcpy part (same arms, timing and ratio:
``gpu_memcpy``), on the FLASH rows only:

- ``rotation``: ``registers`` (a whole-row band rotated in the loaded tile, the default) or
  ``gather`` (each feature's partner loaded again through a computed index, the general path);
- ``block_tokens`` x ``num_warps``: the program's tile (``paged_triton.BLOCK_TOKENS``,
  ``NUM_WARPS``).

``eager``: the microseconds of one ``load_chunk`` call launched from Python (no sync), of its
argument checks alone (``_check_load``) and of the bare kernel launch (``load_chunk_triton`` with
the checked arguments), each the median over many calls of one 1024-token layer: what a layer
costs the worker beyond its device time.

On the CPU (``--device cpu``) it runs the same code under the Triton interpreter on tiny shapes:
a check of this code, not a figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from orbitkv_bench.checks.gpu import set_triton_mode

ROTATIONS = ("registers", "gather")
GPU_TILES = ((16, 4), (32, 4), (32, 8), (64, 8))
CPU_TILES = ((16, 4), (32, 4))


def _sweep(device: torch.device, reps: int) -> list[dict[str, Any]]:
    from orbitkv.kernels import _triton_common, paged_triton
    from orbitkv.kernels.paged import PagedLayout

    from orbitkv_bench.checks import gpu_memcpy

    is_cuda = device.type == "cuda"
    base = gpu_memcpy.GPU_PLAN if is_cuda else gpu_memcpy.CPU_PLAN
    plan = gpu_memcpy.Plan((PagedLayout.FLASH,), base.tokens, base.ranks, base.num_layers,
                           reps, base.warmup)
    defaults = (_triton_common.IS_ROTATE_IN_REGISTERS, paged_triton.BLOCK_TOKENS,
                paged_triton.NUM_WARPS)
    rows = []
    try:
        for rotation in ROTATIONS:
            for block_tokens, num_warps in GPU_TILES if is_cuda else CPU_TILES:
                _triton_common.IS_ROTATE_IN_REGISTERS = rotation == "registers"
                paged_triton.BLOCK_TOKENS, paged_triton.NUM_WARPS = block_tokens, num_warps
                got = gpu_memcpy.run(device, plan)
                for row in got["rows"]:
                    if row["timing"] == "eager":
                        continue
                    rows.append({"rotation": rotation, "block_tokens": block_tokens,
                                 "num_warps": num_warps, **row})
    finally:
        (_triton_common.IS_ROTATE_IN_REGISTERS, paged_triton.BLOCK_TOKENS,
         paged_triton.NUM_WARPS) = defaults
    return rows


def _median_us(fn, num_calls: int, device: torch.device) -> float:
    times = []
    for _ in range(num_calls):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return round(1e6 * statistics.median(times), 2)


def _eager(device: torch.device, num_calls: int) -> dict[str, Any]:
    from orbitkv.kernels import paged
    from orbitkv.kernels.paged import PagedLayout
    from orbitkv.kernels.paged_triton import load_chunk_triton

    from orbitkv_bench.kernels import _spec, make_arms

    layout = PagedLayout.FLASH
    num_tokens = 1024 if device.type == "cuda" else 32
    arms = make_arms(layout, num_tokens, 0, num_timed_layers=1, dtype=torch.bfloat16,
                     device=device)
    arms.fused()  # compile
    spec, delta = _spec(layout), 517
    layer = arms.layers[0]
    args = (layer.cache, layer.slots, layout, layer.k, layer.v, spec, delta, None, None, False)

    def checks():
        paged._check_load(*args)

    views, slots, cos, sin = paged._check_load(*args)

    def launch():
        load_chunk_triton(views, slots, layer.k, layer.v, cos, sin, spec, None, None)

    def call():
        paged.load_chunk(layer.cache, layer.slots, layout, layer.k, layer.v, spec=spec,
                         delta=delta, check_slots=False)

    for fn in (checks, launch, call):
        _median_us(fn, 10, device)
    return {"tokens": num_tokens, "calls": num_calls,
            "load_chunk_us": _median_us(call, num_calls, device),
            "checks_us": _median_us(checks, num_calls, device),
            "launch_us": _median_us(launch, num_calls, device)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orbitkv_bench.checks.gpu_tiles",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--reps", type=int, help="repeats per row (default 12 on CUDA, 2 on the CPU)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device (use --device cpu to check the code)")
    mode = set_triton_mode(device)
    is_cuda = device.type == "cuda"
    doc = {
        "check": "gpu_tiles", "device_name": torch.cuda.get_device_name(device) if is_cuda
        else "cpu", "is_gpu_figure": is_cuda, "triton": mode,
        "eager": _eager(device, 2000 if is_cuda else 20),
        "rows": _sweep(device, args.reps or (12 if is_cuda else 2)),
    }
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    for r in doc["rows"]:
        print(f"{r['rotation']:9s} {r['block_tokens']:3d}x{r['num_warps']} {r['tokens']:5d} tok "
              f"rank {r['rank']:2d}: ratio {r.get('ratio')} {r.get('ratio_spread')} "
              f"{r.get('error', '')}")
    print("eager:", doc["eager"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
