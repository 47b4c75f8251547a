"""Where a request's time goes inside the engine: OrbitKV's own parts next to vLLM's engine time.

Per request (``StepRecord.connector_seconds``: the ``/metrics`` delta of
``vllm:orbitkv_seconds_total{part}`` around it, one request in flight at a time):

- ``in_engine_s``: OrbitKV's parts on the scheduler's and the forward's path (``IN_ENGINE_PARTS``:
  chunk, plan, alloc, meta, output, finish, and the scheduler extension's guard and holes; fetch,
  check, layer_load, save_gather, save_submit, save_wait, and hooks: the rest of the worker's step
  hooks; and on both, stats: vLLM's per-step
  request for the connector's counters, and encoder: the encoder connector's hooks, its lookups
  and reads of stored encoder outputs and its saves' hand-off);
- ``save_writer_s``: the background writer's CPU seconds (off the forward, on the same cores);
  ``save_copy_s``: the time a save's copy out of the cache ran on its own thread, between two
  steps (``connector/worker/saving.py``; the next step waits for it, as ``save_wait``);
- ``load_memcpy_s``: the bytes OrbitKV loaded into the paged cache over this machine's ``memcpy``
  rate, what a load cannot go below; ``excess_s = in_engine_s - load_memcpy_s``, the time the
  issue's target (1 ms) is about;
- ``mm_hash_s``: the part of ``chunk`` spent hashing new multimodal items' inputs (BLAKE3 over
  their pixels: the store's content identity, ``connector/mm_identity.py``), a rate-bound cost like
  the memcpy; none for an item whose hash vLLM's front end vouched for (``vllm_ext/mm_hashes.py``); ``excess_beyond_hash_s`` is ``excess_s`` without it (shown beside, not the target);

next to vLLM's own ``engine_ttft_s`` (scheduled to first token). Figures are medians (p50) and
p95 over the requests that have the delta.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

IN_ENGINE_PARTS = (
    "chunk", "plan", "alloc", "meta", "output", "finish", "guard", "holes", "stats",
    "fetch", "check", "layer_load", "save_gather", "save_submit", "save_wait", "hooks", "encoder",
)
EXCESS_TARGET_S = 1e-3


def memcpy_nbytes_per_s(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """This machine's large-copy rate (best of ``repeats``, buffers faulted in first)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def token_kv_nbytes(model_dir: str | Path, dtype_nbytes: int = 2) -> int:
    """KV bytes one token takes in the paged cache of a local model (K and V, every layer)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return text["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_nbytes


def breakdown(records: Sequence[Any], token_nbytes: int, copy_nbytes_per_s: float) -> dict[str, Any] | None:
    """The per-request figures (module doc) of one arm's records; None without OrbitKV's parts."""
    rows = []
    for r in records:
        parts = r.connector_seconds
        if not parts:
            continue
        in_engine = sum(parts.get(p, 0.0) for p in IN_ENGINE_PARTS)
        memcpy = (r.connector_tokens or 0) * token_nbytes / copy_nbytes_per_s
        mm_hash = parts.get("mm_hash", 0.0)
        rows.append({"parts": parts, "in_engine_s": in_engine, "load_memcpy_s": memcpy,
                     "excess_s": in_engine - memcpy, "mm_hash_s": mm_hash,
                     "excess_beyond_hash_s": in_engine - memcpy - mm_hash,
                     "save_writer_s": parts.get("save_writer", 0.0),
                     "save_copy_s": parts.get("save_copy", 0.0),
                     "engine_ttft_s": r.engine_ttft_s})
    if not rows:
        return None
    parts = sorted({p for row in rows for p in row["parts"]})
    engine = [row["engine_ttft_s"] for row in rows if row["engine_ttft_s"] is not None]
    excess = [row["excess_s"] for row in rows]
    return {
        "num_requests": len(rows),
        "engine_ttft_p50_s": _round(_p(engine, 50)),
        "in_engine_p50_s": _round(_p([row["in_engine_s"] for row in rows], 50)),
        "in_engine_p95_s": _round(_p([row["in_engine_s"] for row in rows], 95)),
        "load_memcpy_p50_s": _round(_p([row["load_memcpy_s"] for row in rows], 50)),
        "excess_p50_s": _round(_p(excess, 50)),
        "excess_p95_s": _round(_p(excess, 95)),
        "share_within_target": round(sum(e <= EXCESS_TARGET_S for e in excess) / len(excess), 3),
        "mm_hash_p50_s": _round(_p([row["mm_hash_s"] for row in rows], 50)),
        "excess_beyond_hash_p50_s": _round(_p([row["excess_beyond_hash_s"] for row in rows], 50)),
        "save_writer_p50_s": _round(_p([row["save_writer_s"] for row in rows], 50)),
        "save_copy_p50_s": _round(_p([row["save_copy_s"] for row in rows], 50)),
        "by_part_p50_s": {p: _round(_p([row["parts"].get(p, 0.0) for row in rows], 50)) for p in parts},
        "by_part_mean_s": {p: _round(statistics.fmean(row["parts"].get(p, 0.0) for row in rows)) for p in parts},
        "token_kv_nbytes": token_nbytes,
        "memcpy_gb_per_s": round(copy_nbytes_per_s / 1e9, 2),
    }


def time_breakdowns(records_by_system: dict[str, Sequence[Any]], model_dir: str | Path) -> dict[str, Any]:
    """``breakdown`` for every arm that reported OrbitKV's parts."""
    rate = memcpy_nbytes_per_s()
    nbytes = token_kv_nbytes(model_dir)
    out = {s: breakdown(rs, nbytes, rate) for s, rs in records_by_system.items()}
    return {s: b for s, b in out.items() if b is not None}


def format_breakdown(system: str, b: dict[str, Any]) -> str:
    ms = 1e3
    parts = ", ".join(f"{p} {v * ms:.2f}" for p, v in b["by_part_mean_s"].items() if v)
    return (
        f"  {system:<16} OrbitKV in the engine p50 {b['in_engine_p50_s'] * ms:.2f} ms (p95 "
        f"{b['in_engine_p95_s'] * ms:.2f}) of vLLM's engine TTFT p50 {(b['engine_ttft_p50_s'] or 0) * ms:.1f} ms; "
        f"beyond the load's memcpy time p50 {b['excess_p50_s'] * ms:.2f} ms, p95 {b['excess_p95_s'] * ms:.2f} "
        f"({100 * b['share_within_target']:.0f}% of {b['num_requests']} requests within 1 ms), "
        f"{b['excess_beyond_hash_p50_s'] * ms:.2f} beyond hashing new images' inputs too; "
        f"background writer p50 {b['save_writer_p50_s'] * ms:.2f} ms CPU, save copies between steps "
        f"p50 {(b.get('save_copy_p50_s') or 0) * ms:.2f} ms\n"
        f"  {'':<16} mean ms per part: {parts}"
    )


def _p(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 6)
