"""``orbitkv bench kernels [--json] [--quick]``: fused load (relocate + patch + scatter) vs memcpy.

For each layout, chunk size and patch rank, one layer's staged chunk is relocated (a non-zero
delta), patched (rank 0 = no patch) and scattered into a paged cache through a slot mapping of
shuffled whole blocks, as a load would do (``--slots consecutive``: one run of consecutive
blocks). Throughput counts the bytes the load must read (K, V, patch factors, slots) and write (K, V); ``memcpy_gbps`` is a plain ``copy_`` of the same K/V payload
on the same device in the same run (bytes read + written), and ``ratio`` = ``gbps / memcpy_gbps``.
Rows with ``op: gather`` time the inverse, ``gather_chunk`` (the save path: K/V and slots read,
K/V written), once per chunk size (rank does not apply). ``--ops load_many gather_many`` (CPU_VEC
and CPU_AMX caches, rank 0) time the worker's one call a step for every timed layer: the native
``load_many`` / ``gather_many`` (every layer reading the first one's slots).

Shape: a 7B-like model (28 layers, 4 KV heads, head dim 128, bf16); MLA rows are DeepSeek-V2-like
(kv_lora_rank 512 + rope 64). Every layer does the same work on its own tensors, so a subset of the
layers is timed and the per-model time is scaled from it (``timed_layers`` in the JSON). CPU runs the
production CPU path (``backend='auto'``: ``paged_cpu`` for cpu_vec, the torch reference otherwise),
CUDA the Triton kernels. CPU threads default to torch's own setting, as the engine runs; ``--threads``
pins them (the shared-machine numbers in the docs use both 1 and the default).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from orbitkv.kernels import native
from orbitkv.kernels.paged import PagedLayout, gather_chunk, gather_many, load_chunk, load_many
from orbitkv.kernels.rope import RopeSpec

from orbitkv_bench.checks.numerics import make_spec

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 28, 4, 128
MLA_LORA, MLA_ROPE = 512, 64
BLOCK_SIZE = {PagedLayout.FLASH: 16, PagedLayout.CPU_VEC: 32, PagedLayout.CPU_AMX: 32,
              PagedLayout.MLA: 16}
DEFAULT_TOKENS = (256, 512, 1024, 2048, 4096)
QUICK_TOKENS = (256, 1024)
DEFAULT_RANKS = (0, 16, 64)
QUICK_RANKS = (0, 16)
DELTA = 517
OPS = ("load", "gather", "load_many", "gather_many")
MANY_LAYOUTS = (PagedLayout.CPU_VEC, PagedLayout.CPU_AMX)


def _spec(layout: PagedLayout) -> RopeSpec:
    if layout is PagedLayout.MLA:
        return make_spec("gptj", MLA_LORA + MLA_ROPE, MLA_ROPE, rope_offset=MLA_LORA)
    return make_spec("neox", HEAD_DIM, HEAD_DIM)


def _make_cache(layout: PagedLayout, num_blocks: int, dtype, device) -> torch.Tensor:
    bs = BLOCK_SIZE[layout]
    if layout is PagedLayout.FLASH:
        return torch.zeros(num_blocks, 2, bs, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    if layout in (PagedLayout.CPU_VEC, PagedLayout.CPU_AMX):
        return torch.zeros(num_blocks, NUM_KV_HEADS, bs, 2 * HEAD_DIM, dtype=dtype, device=device)
    return torch.zeros(num_blocks, bs, MLA_LORA + MLA_ROPE, dtype=dtype, device=device)


class _Layer:
    """One layer's staged chunk, patch factors and paged cache."""

    def __init__(self, layout, num_tokens, rank, dtype, device, slots="shuffled"):
        is_mla = layout is PagedLayout.MLA
        shape = (num_tokens, MLA_LORA + MLA_ROPE) if is_mla else (num_tokens, NUM_KV_HEADS, HEAD_DIM)
        num_features = shape[1] if is_mla else NUM_KV_HEADS * HEAD_DIM
        bs = BLOCK_SIZE[layout]
        num_blocks = 2 * (num_tokens + bs - 1) // bs
        self.cache = _make_cache(layout, num_blocks, dtype, device)
        self.k = torch.randn(shape, device=device).to(dtype)
        self.v = None if is_mla else torch.randn(shape, device=device).to(dtype)
        blocks = torch.randperm(num_blocks, device=device)[: (num_tokens + bs - 1) // bs]
        if slots == "consecutive":
            blocks = torch.arange(blocks.numel(), device=device) + num_blocks // 4
        self.slots = (blocks[:, None] * bs + torch.arange(bs, device=device)).flatten()[:num_tokens]

        def factors():
            return (torch.randn(num_tokens, rank, device=device),
                    torch.randn(rank, num_features, device=device))

        self.patch_k = factors() if rank else None
        self.patch_v = factors() if rank and not is_mla else None
        self.kv_nbytes = sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)
        patch_nbytes = sum(t.numel() * t.element_size()
                           for p in (self.patch_k, self.patch_v) if p is not None for t in p)
        self.moved_nbytes = 2 * self.kv_nbytes + patch_nbytes + self.slots.numel() * 8


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_pair(first, second, reps: int, device: torch.device) -> tuple[float, float]:
    """Best wall times of ``first`` and ``second`` over ``reps`` alternating runs, after a warm-up.

    Alternating keeps both under the same machine load, and the best run is the one least disturbed
    by other work on a shared CPU (contention only ever adds time).
    """
    times: tuple[list[float], list[float]] = ([], [])
    for rep in range(reps + 1):
        for fn, out in ((first, times[0]), (second, times[1])):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            if rep:
                out.append(time.perf_counter() - start)
    return min(times[0]), min(times[1])


@dataclasses.dataclass(frozen=True)
class Arms:
    """The two timed callables of one measurement over ``num_layers`` layers, and the bytes each
    moves per layer (read + written): the fused op's own, and memcpy's of the same K/V payload."""

    fused: Callable[[], None]
    memcpy: Callable[[], None]
    moved_nbytes: int
    memcpy_nbytes: int
    num_layers: int
    layers: list[_Layer]


def make_arms(layout, num_tokens, rank, *, num_timed_layers, dtype, device, slots="shuffled",
              op="load") -> Arms:
    """``op`` ``load``: relocate + patch + scatter per layer (``load_chunk``); ``gather``:
    ``gather_chunk``. ``memcpy``: ``copy_`` of each layer's K/V payload between two buffers."""
    layers = [_Layer(layout, num_tokens, rank, dtype, device, slots)
              for _ in range(num_timed_layers)]
    spec = _spec(layout)

    caches = [layer.cache for layer in layers]

    def fused():
        if op == "load_many":
            assert load_many(caches, layout, [layer.slots for layer in layers],
                             [layer.k for layer in layers], [layer.v for layer in layers],
                             spec=spec, deltas=[DELTA] * len(layers)), "load_many did not run"
            return
        if op == "gather_many":
            assert gather_many(caches, layers[0].slots, layout) is not None, "gather_many did not run"
            return
        for layer in layers:
            if op == "gather":
                gather_chunk(layer.cache, layer.slots, layout)
                continue
            load_chunk(layer.cache, layer.slots, layout, layer.k, layer.v, spec=spec, delta=DELTA,
                       patch_k=layer.patch_k, patch_v=layer.patch_v, check_slots=False)

    payload_nbytes = layers[0].kv_nbytes
    srcs = [torch.empty(payload_nbytes, dtype=torch.uint8, device=device).random_(0, 255)
            for _ in layers]
    dsts = [torch.empty_like(s) for s in srcs]

    def memcpy():
        for src, dst in zip(srcs, dsts, strict=True):
            dst.copy_(src)

    moved_nbytes = layers[0].moved_nbytes if op.startswith("load") else 2 * payload_nbytes + (
        layers[0].slots.numel() * 8)
    return Arms(fused, memcpy, moved_nbytes, 2 * payload_nbytes, num_timed_layers, layers)


def bench_one(layout, num_tokens, rank, *, num_timed_layers, reps, dtype, device,
              slots="shuffled", op="load") -> dict[str, Any]:
    arms = make_arms(layout, num_tokens, rank, num_timed_layers=num_timed_layers, dtype=dtype,
                     device=device, slots=slots, op=op)
    fused_s, memcpy_s = _time_pair(arms.fused, arms.memcpy, reps, device)
    moved_nbytes = arms.moved_nbytes
    gbps = moved_nbytes * num_timed_layers / fused_s / 1e9
    memcpy_gbps = arms.memcpy_nbytes * num_timed_layers / memcpy_s / 1e9
    return {
        "op": op,
        "tokens": num_tokens,
        "rank": rank,
        "layout": layout.value,
        "slots": slots,
        "device": str(device),
        "gbps": _sig(gbps),
        "memcpy_gbps": _sig(memcpy_gbps),
        "ratio": _sig(gbps / memcpy_gbps),
        "ms_per_layer": round(1e3 * fused_s / num_timed_layers, 4),
        "ms_model": round(1e3 * fused_s / num_timed_layers * NUM_LAYERS, 3),
        "bytes_per_layer": moved_nbytes,
    }


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="orbitkv bench kernels", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--quick", action="store_true", help="fewer sizes, ranks and repetitions")
    p.add_argument("--tokens", type=int, nargs="+", help="chunk sizes (default 256..4096)")
    p.add_argument("--ranks", type=int, nargs="+", help="patch ranks (default 0 16 64)")
    p.add_argument("--layouts", nargs="+", choices=[x.value for x in PagedLayout])
    p.add_argument("--timed-layers", type=int, help="layers timed per measurement (default: "
                   "all 28 on CUDA, 2 on CPU; the model time is scaled from them)")
    p.add_argument("--reps", type=int, help="timed repetitions (the best is reported)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's own default, as the engine runs)")
    p.add_argument("--slots", choices=["shuffled", "consecutive"], default="shuffled",
                   help="slot mapping: whole blocks in shuffled order (default) or consecutive blocks")
    p.add_argument("--ops", nargs="+", choices=list(OPS), default=["load", "gather"],
                   help="what to time (default load and gather; the *_many ops on CPU_VEC and "
                   "CPU_AMX caches only)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    tokens = args.tokens or (QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    ranks = args.ranks or (QUICK_RANKS if args.quick else DEFAULT_RANKS)
    # CPU_AMX is vLLM's CPU-only packing: no CUDA cache has it.
    layouts = [PagedLayout(x) for x in args.layouts] if args.layouts else [
        x for x in PagedLayout if device.type == "cpu" or x is not PagedLayout.CPU_AMX]
    timed_layers = args.timed_layers or (NUM_LAYERS if device.type == "cuda" else (1 if args.quick else 2))
    reps = args.reps or (2 if args.quick else (10 if device.type == "cuda" else 5))
    dtype = torch.bfloat16
    torch.manual_seed(0)
    rows = []
    started = time.perf_counter()
    for layout in layouts:
        for num_tokens in tokens:
            for op in args.ops:
                if op.endswith("_many") and (layout not in MANY_LAYOUTS or device.type != "cpu"):
                    continue
                for rank in ranks if op == "load" else ranks[:1]:
                    rows.append(bench_one(layout, num_tokens, rank if op == "load" else 0,
                                          num_timed_layers=timed_layers, reps=reps, dtype=dtype,
                                          device=device, slots=args.slots, op=op))
    doc = {
        "benchmark": "kernels.fused_load",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "path": "triton" if device.type == "cuda" else (
            "cpu_vec: native op (kernels/csrc/cpu_vec.cpp)" if native.library() is not None
            else "cpu_vec: eager torch (no C++ compiler)") + "; cpu_amx: vLLM's writer (load), torch "
            "(gather), the native op (*_many); flash/mla: torch",
        "slots": args.slots,
        "dtype": "bfloat16",
        "shape": {"num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "mla_row": MLA_LORA + MLA_ROPE, "block_size": {k.value: v for k, v in BLOCK_SIZE.items()}},
        "timed_layers": timed_layers,
        "scaled_from_timed_layers": timed_layers < NUM_LAYERS,
        "note": ("gbps, memcpy_gbps and ratio are per layer, measured over timed_layers layers; "
                 "ms_model scales ms_per_layer to all num_layers"),
        "reps": reps,
        "timing": "best of reps; fused and memcpy runs alternate",
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "quick": bool(args.quick),
        "seconds": round(time.perf_counter() - started, 2),
        "rows": rows,
        "summary": _summary(rows),
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_table(doc)
    return 0


def _summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean ratio per layout and rank (loads), and of the gathers."""
    ratios: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        name = f"rank{row['rank']}" if row["op"] == "load" else "gather"
        ratios.setdefault(row["layout"], {}).setdefault(name, []).append(row["ratio"])
    return {lay: {r: _sig(statistics.mean(v)) for r, v in d.items()} for lay, d in ratios.items()}


def _print_table(doc: dict[str, Any]) -> None:
    print(f"fused load vs memcpy on {doc['device_name']} ({doc['path']} path, bf16, "
          f"{doc['timed_layers']} timed layers)")
    print(f"{'layout':<8} {'op':<6} {'tokens':>6} {'rank':>4} {'GB/s':>9} {'memcpy':>9} {'ratio':>7} "
          f"{'ms/model':>9}")
    for r in doc["rows"]:
        print(f"{r['layout']:<8} {r['op']:<6} {r['tokens']:>6} {r['rank']:>4} {r['gbps']:>9.2f} "
              f"{r['memcpy_gbps']:>9.2f} {r['ratio']:>7.3f} {r['ms_model']:>9.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
