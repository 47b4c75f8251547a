"""What ``bench fidelity`` computes from the answers: per-question comparisons with the reference (a
full prefill of the same prompt), their summary per operation and arm, and the calibration table.

- ``first_token_kl``: KL(reference || arm) of the first answer token, from both sides' top-k
  logprobs over the union of their tokens; a token missing from one side's list gets that side's
  smallest listed logprob (an upper bound on its true value), and both sides are renormalised
  over the union;
- ``is_same_answer``: the greedy answers are equal (their first ``max_tokens`` tokens);
- ``is_correct``: the answer contains the expected value (case-insensitive, whole word).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# The table the serving policy reads: its format and the modes it calibrates.
from orbitkv.connector.scheduler.calibration import CALIBRATED_MODES, FORMAT, first_token_kl

# ``min_served_questions``: fewer questions served in a mode measure nothing (one question
# answered alike would be "100%").
BUDGET = {"min_agreement": 0.95, "min_agreement_two_hop": 0.90, "min_served_questions": 10}


def top1(logprobs: Mapping[str, float]) -> str | None:
    return max(logprobs, key=logprobs.__getitem__) if logprobs else None


def is_correct(answer: str, expected: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(expected)}(?![\w])", answer, re.IGNORECASE) is not None


@dataclass
class Comparison:
    """One question on one arm, against the reference's answer to the same prompt."""

    episode: int
    step: int
    op: str
    hops: int
    arm: str
    answer: str
    reference_answer: str
    is_same_answer: bool
    is_same_top1: bool | None
    kl: float | None
    is_correct: bool
    is_reference_correct: bool
    prompt_tokens: int | None
    computed_tokens: int | None
    ttft_s: float | None
    reference_computed_tokens: int | None
    reference_ttft_s: float | None
    reused_by_mode: dict[str, int] | None = None
    # Tokens served in the arm's own mode (and ``inherited``: computed over its KV); 0 when the
    # mode had nothing to serve and the request was exact or computed.
    mode_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> Comparison:
        return cls(**{k: v for k, v in row.items() if k in cls.__dataclass_fields__})


def mode_tokens(mode: str, by_mode: Mapping[str, int] | None) -> int:
    """Tokens an arm served in its own mode (an approximate mode's ``inherited`` tokens with it)."""
    modes = (mode,) if mode == "exact" else (mode, "inherited")
    return sum(int((by_mode or {}).get(m, 0)) for m in modes)


def compare(
    arm: str,
    step: Any,
    expected: str,
    ref: Mapping[str, Any],
    out: Mapping[str, Any],
    mode: str = "exact",
) -> Comparison:
    """``ref``/``out``: answer, first (token -> logprob), prompt/computed tokens, ttft_s, by_mode;
    ``mode``: the arm's own reuse mode."""
    t_ref, t_out = top1(ref["first"]), top1(out["first"])
    return Comparison(
        episode=step.episode, step=step.index, op=step.op, hops=step.question.hops, arm=arm,
        answer=out["answer"], reference_answer=ref["answer"],
        is_same_answer=out["answer"] == ref["answer"],
        is_same_top1=None if t_ref is None or t_out is None else t_ref == t_out,
        kl=first_token_kl(ref["first"], out["first"]),
        is_correct=is_correct(out["answer"], expected),
        is_reference_correct=is_correct(ref["answer"], expected),
        prompt_tokens=out.get("prompt_tokens"), computed_tokens=out.get("computed_tokens"),
        ttft_s=out.get("ttft_s"), reference_computed_tokens=ref.get("computed_tokens"),
        reference_ttft_s=ref.get("ttft_s"), reused_by_mode=out.get("by_mode"),
        mode_tokens=mode_tokens(mode, out.get("by_mode")),
    )


def _rate(flags: Iterable[bool | None]) -> float | None:
    known = [f for f in flags if f is not None]
    return round(sum(known) / len(known), 4) if known else None


def _sum(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def summarize(rows: Sequence[Comparison]) -> dict[str, Any]:
    """Agreement, first-token KL and top-1, accuracy (and the reference's), tokens and TTFT."""
    kls = [r.kl for r in rows if r.kl is not None]
    two_hop = [r for r in rows if r.hops == 2]
    computed, ref_computed = (
        _sum(r.computed_tokens for r in rows),
        _sum(r.reference_computed_tokens for r in rows),
    )
    ttft = [r.ttft_s for r in rows if r.ttft_s is not None]
    ref_ttft = [r.reference_ttft_s for r in rows if r.reference_ttft_s is not None]
    by_mode: dict[str, int] = {}
    for r in rows:
        for mode, n in (r.reused_by_mode or {}).items():
            by_mode[mode] = by_mode.get(mode, 0) + n
    served = [r for r in rows if r.mode_tokens > 0]
    served_kls = [r.kl for r in served if r.kl is not None]
    return {
        "num_questions": len(rows),
        # The questions where the arm's mode served tokens, and their own figures: over all
        # questions a mode that rarely serves looks as good as exact.
        "num_served": len(served),
        "agreement_served": _rate(r.is_same_answer for r in served),
        "agreement_two_hop_served": _rate(r.is_same_answer for r in served if r.hops == 2),
        "kl_mean_served": round(statistics.fmean(served_kls), 5) if served_kls else None,
        "agreement": _rate(r.is_same_answer for r in rows),
        "agreement_single_hop": _rate(r.is_same_answer for r in rows if r.hops == 1),
        "agreement_two_hop": _rate(r.is_same_answer for r in two_hop),
        "num_two_hop": len(two_hop),
        "top1_agreement": _rate(r.is_same_top1 for r in rows),
        "kl_mean": round(statistics.fmean(kls), 5) if kls else None,
        "kl_p90": round(sorted(kls)[int(0.9 * (len(kls) - 1))], 5) if kls else None,
        "accuracy": _rate(r.is_correct for r in rows),
        "reference_accuracy": _rate(r.is_reference_correct for r in rows),
        "prompt_tokens": _sum(r.prompt_tokens for r in rows),
        "computed_tokens": computed,
        "reference_computed_tokens": ref_computed,
        "tokens_computed_ratio": round(computed / ref_computed, 4)
        if computed is not None and ref_computed
        else None,
        "ttft_p50_s": round(statistics.median(ttft), 4) if ttft else None,
        "reference_ttft_p50_s": round(statistics.median(ref_ttft), 4) if ref_ttft else None,
        "reused_tokens_by_mode": by_mode,
    }


def frontier(rows: Sequence[Comparison], *, with_start: bool = False) -> dict[str, Any]:
    """Per arm: the summary over all its questions (the start step excluded unless ``with_start``:
    nothing is reused there) and per operation."""
    out: dict[str, Any] = {}
    for arm in dict.fromkeys(r.arm for r in rows):
        mine = [r for r in rows if r.arm == arm]
        ops = dict.fromkeys(r.op for r in mine)
        out[arm] = {
            "all": summarize([r for r in mine if with_start or r.op != "start"]),
            "by_op": {op: summarize([r for r in mine if r.op == op]) for op in ops},
        }
    return out


def within_budget(summary: Mapping[str, Any], budget: Mapping[str, float] = BUDGET) -> bool:
    """Agreement and two-hop agreement at least the budget's, over all questions and over those
    the mode served, on at least ``min_served_questions`` of those."""

    def meets(a: float | None, b: float | None) -> bool:
        return (
            a is not None
            and a >= budget["min_agreement"]
            and (b is None or b >= budget["min_agreement_two_hop"])
        )

    return (
        meets(summary.get("agreement"), summary.get("agreement_two_hop"))
        and meets(summary.get("agreement_served"), summary.get("agreement_two_hop_served"))
        and summary.get("num_served", 0) >= budget.get("min_served_questions", 0)
    )


def calibration_table(
    arms: Mapping[str, Mapping[str, Any]],
    results: Mapping[str, Any],
    *,
    model_fingerprint: str,
    model: str,
    modality: str = "text",
    budget: Mapping[str, float] = BUDGET,
) -> dict[str, Any]:
    """One row per live arm in a calibrated mode (``arms``: name -> {"mode", "patch_rank"}).
    ``results``: ``frontier`` output; the rows use each arm's summary over all its questions."""
    rows = []
    for name, spec in arms.items():
        if spec["mode"] not in CALIBRATED_MODES or name not in results:
            continue
        s = results[name]["all"]
        if not s["num_questions"]:
            continue
        row = {
            "modality": modality,
            "mode": spec["mode"],
            "num_questions": s["num_questions"],
            "agreement": s["agreement"],
            "agreement_two_hop": s["agreement_two_hop"],
            "top1_agreement": s["top1_agreement"],
            "kl_mean": s["kl_mean"],
            "tokens_computed_ratio": s["tokens_computed_ratio"],
            "num_served": s["num_served"],
            "agreement_served": s["agreement_served"],
            "agreement_two_hop_served": s["agreement_two_hop_served"],
            "is_within_budget": within_budget(s, budget),
        }
        if spec["mode"] == "patched":
            row["patch_rank"] = int(spec["patch_rank"])
        if spec["mode"] == "recompute":
            row["recompute_fraction"] = float(spec["recompute_fraction"])
        rows.append(row)
    return {
        "format": FORMAT,
        "model_fingerprint": model_fingerprint,
        "model": model,
        "budget": dict(budget),
        "rows": rows,
    }
