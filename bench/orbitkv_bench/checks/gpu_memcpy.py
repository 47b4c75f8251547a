"""The fused load (relocate + patch + scatter, ``load_chunk``) against a device-to-device memcpy of
the same K/V bytes: part ``memcpy`` of ``orbitkv check gpu``.

The two arms and the byte counts are ``orbitkv bench kernels``' (``bench.kernels.make_arms``): a
7B-like layer (4 KV heads x 128, bf16) or a DeepSeek-V2-like MLA row, shuffled whole blocks, delta
517, over ``num_layers`` layers with their own tensors (28 on CUDA: more than the L2 cache holds).
``ratio`` is the fused load's GB/s (bytes it reads and writes) over memcpy's (bytes read and
written), taken per repeat from two adjacent runs; the median and the spread over the repeats
are reported.

On CUDA each arm is timed with CUDA events after a warm-up, twice: replayed from a CUDA graph
(``cuda_graph``: device time, the kernel against the copy engine's work, what the goal is judged
on) and launched from Python (``eager``: plus the Python and launch cost of one ``load_chunk``
call per layer, which a load pays today). On the CPU (``--device cpu``) the arms run the CPU
production path, timed with ``perf_counter``: a check of this code, not a GPU figure.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from orbitkv.kernels.paged import PagedLayout

from orbitkv_bench.kernels import NUM_LAYERS, make_arms

GOAL = 0.8


@dataclass(frozen=True)
class Plan:
    layouts: tuple[PagedLayout, ...]
    tokens: tuple[int, ...]
    ranks: tuple[int, ...]
    num_layers: int
    reps: int
    warmup: int


GPU_PLAN = Plan((PagedLayout.FLASH, PagedLayout.MLA), (1024, 4096), (0, 16), NUM_LAYERS, 20, 3)
CPU_PLAN = Plan((PagedLayout.FLASH, PagedLayout.MLA), (64,), (0, 4), 2, 3, 1)


def describe(plan: Plan) -> list[str]:
    return [
        f"fused load_chunk ({layout.value} cache, {tokens} tokens, rank {rank}, bf16, "
        f"{plan.num_layers} layers) vs device-to-device copy_ of the same K/V bytes: GB/s ratio, "
        f"median and spread over {plan.reps} repeats after {plan.warmup} warm-up, CUDA events, "
        f"CUDA-graph replay and eager; goal >= {GOAL}"
        for layout in plan.layouts for tokens in plan.tokens for rank in plan.ranks
    ]


def run(device: torch.device, plan: Plan) -> dict[str, Any]:
    is_cuda = device.type == "cuda"
    torch.manual_seed(0)
    rows = []
    for layout in plan.layouts:
        for num_tokens in plan.tokens:
            for rank in plan.ranks:
                arms = make_arms(layout, num_tokens, rank, num_timed_layers=plan.num_layers,
                                 dtype=torch.bfloat16, device=device)
                base = {"op": "load", "layout": layout.value, "tokens": num_tokens, "rank": rank,
                        "num_layers": plan.num_layers}
                for timing, fused, memcpy in _modes(arms, device):
                    if isinstance(fused, Exception):
                        rows.append({**base, "timing": timing, "error": repr(fused)})
                        continue
                    rows.append({**base, "timing": timing,
                                 **_measure(arms, fused, memcpy, device, plan)})
                del arms
                if is_cuda:
                    torch.cuda.empty_cache()
    judged = [r for r in rows if r["timing"] == "cuda_graph"]
    return {
        "ok": all(r.get("meets_goal") for r in judged) if is_cuda else None,
        "is_gpu_figure": is_cuda,
        "goal": GOAL,
        "judged_on": "cuda_graph" if is_cuda else "nothing: CPU tensors, not a GPU figure",
        "rows": rows,
    }


def _modes(arms, device: torch.device):
    """(timing name, fused callable, memcpy callable); an Exception in place of the callables
    when they cannot be built (a CUDA graph that fails to capture)."""
    if device.type != "cuda":
        yield "perf_counter (CPU tensors, not a GPU figure)", arms.fused, arms.memcpy
        return
    try:
        for fn in (arms.fused, arms.memcpy):
            fn()  # compile the Triton kernel and build the cos/sin tables before any capture
        torch.cuda.synchronize(device)
    except Exception as exc:  # a launch the device refuses fails its arm, not the whole part
        yield "cuda_graph", exc, exc
        return
    try:
        yield "cuda_graph", _graph(arms.fused, device), _graph(arms.memcpy, device)
    except RuntimeError as exc:
        yield "cuda_graph", exc, exc
    yield "eager", arms.fused, arms.memcpy


def _graph(fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``fn`` captured once in a CUDA graph (after a warm-up on a side stream, as torch asks)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _time_s(fn: Callable[[], None], device: torch.device) -> float:
    if device.type != "cuda":
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _measure(arms, fused, memcpy, device: torch.device, plan: Plan) -> dict[str, Any]:
    fused_s, memcpy_s, ratios = [], [], []
    for rep in range(plan.warmup + plan.reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # Alternate which arm goes first, so neither always runs after the other's cache traffic.
        order = ("fused", "memcpy") if rep % 2 == 0 else ("memcpy", "fused")
        fns = {"fused": fused, "memcpy": memcpy}
        times = {name: _time_s(fns[name], device) for name in order}
        if rep < plan.warmup:
            continue
        fused_s.append(times["fused"])
        memcpy_s.append(times["memcpy"])
        gbps = arms.moved_nbytes * arms.num_layers / times["fused"] / 1e9
        memcpy_gbps = arms.memcpy_nbytes * arms.num_layers / times["memcpy"] / 1e9
        ratios.append(gbps / memcpy_gbps)
    ratio = statistics.median(ratios)
    med_fused, med_memcpy = statistics.median(fused_s), statistics.median(memcpy_s)
    return {
        "ratio": _sig(ratio),
        "ratio_spread": [_sig(min(ratios)), _sig(max(ratios))],
        "gbps": _sig(arms.moved_nbytes * arms.num_layers / med_fused / 1e9),
        "memcpy_gbps": _sig(arms.memcpy_nbytes * arms.num_layers / med_memcpy / 1e9),
        "fused_ms": _sig(1e3 * med_fused),
        "memcpy_ms": _sig(1e3 * med_memcpy),
        "bytes_per_layer": arms.moved_nbytes,
        "memcpy_bytes_per_layer": arms.memcpy_nbytes,
        "reps": plan.reps,
        "meets_goal": bool(ratio >= GOAL) if device.type == "cuda" else None,
    }


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")
