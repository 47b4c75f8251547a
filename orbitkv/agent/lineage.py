"""What ``bench agent`` reports of the exactness boundary: its cost and its effect.

- ``lineage_cost``: per OrbitKV arm, the bytes its store holds by kind and lineage (exact
  conditioned entries, approximate ones under a policy, canonicals, patches, encoder outputs),
  read off the arm's disk tier after the run, and the share of prompt tokens that sat in
  approximate-lineage blocks of vLLM's prefix cache (every token from ``approximate_from`` on).
- ``fidelity``: per arm and step kind, how often its greedy answer equals the reference arm's
  (no cache: a full prefill) for the same request, with seeded weights.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any


def lineage_cost(store_dir: Path, records: list[Any]) -> dict[str, Any]:
    from orbitkv.store.cli import disk_files
    from orbitkv.store.keys import EntryKey

    by_kind: Counter[str] = Counter()
    if store_dir.is_dir():
        for _, key, nbytes in disk_files(str(store_dir)):
            try:
                parsed = EntryKey.parse(key)
            except ValueError:
                by_kind["other"] += nbytes
                continue
            kind = parsed.kind
            if kind == "conditioned":
                kind = "conditioned.exact" if parsed.is_exact else "conditioned.approximate"
            by_kind[kind] += nbytes
    prompt = approx = 0
    for r in records:
        summary = r.orbitkv or {}
        if not r.prompt_tokens:
            continue
        prompt += r.prompt_tokens
        start = summary.get("approximate_from")
        if start is not None:
            approx += max(0, r.prompt_tokens - int(start))
    conditioned = by_kind["conditioned.exact"] + by_kind["conditioned.approximate"]
    return {
        "stored_bytes": dict(by_kind),
        "approximate_share_of_conditioned_bytes": round(by_kind["conditioned.approximate"] / conditioned, 4)
        if conditioned else None,
        "prompt_tokens": prompt,
        "prompt_tokens_in_approximate_blocks": approx,
        "approximate_share_of_prompt_tokens": round(approx / prompt, 4) if prompt else None,
    }


def fidelity(records: dict[str, list[Any]], reference: str = "none") -> dict[str, Any] | None:
    ref = {(r.episode, r.step): r.answer for r in records.get(reference, ())}
    if not ref:
        return None
    out: dict[str, Any] = {}
    for system, rs in records.items():
        if system == reference:
            continue
        same: Counter[str] = Counter()
        total: Counter[str] = Counter()
        for r in rs:
            want = ref.get((r.episode, r.step))
            if want is None:
                continue
            total[r.kind] += 1
            same[r.kind] += r.answer == want
        out[system] = {
            "greedy_agreement": round(sum(same.values()) / sum(total.values()), 3) if total else None,
            "by_kind": {k: round(same[k] / total[k], 3) for k in total},
        }
    return out
