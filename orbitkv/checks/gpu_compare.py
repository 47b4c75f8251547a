"""One prompt sent to the OrbitKV server and to the reference server, compared: the requests and
rows of ``gpu_server`` (part ``server`` of ``orbitkv check gpu``).

- ``generate``: greedy ``MAX_TOKENS`` tokens with their logprobs, OrbitKV asked for exact reuse
  only; the loads and holes happen here. The tokens must be equal, the logprobs within ``atol``,
  and the expected prefix-run and hole tokens served.
- ``prompt_logprobs``: vLLM skips every cache read for a request that asks for prompt logprobs
  (``SamplingParams.skip_reading_prefix_cache``: a loaded token has none), so OrbitKV must serve
  it nothing; its prompt logprobs must equal the reference's. Sent with saving off.
"""

from __future__ import annotations

from typing import Any

from orbitkv.serving.http_client import http_post_json

MAX_TOKENS = 16
SERVED_NAME = "orbitkv-check"
EXACT_ONLY = {"modes": ["exact"]}


def complete(base_url: str, ids: list[int], params: dict | None, **body: Any) -> dict[str, Any]:
    """``/v1/completions`` for token ids, greedy; ``params``: OrbitKV's per-request options."""
    req = {"model": SERVED_NAME, "prompt": ids, "temperature": 0.0, "return_token_ids": True,
           **body}
    if params is not None:
        req["kv_transfer_params"] = {"orbitkv": params}
    status, data = http_post_json(base_url, "/v1/completions", req, timeout=300.0)
    if status != 200:
        raise RuntimeError(f"HTTP {status} from {base_url}/v1/completions: {str(data)[:2000]}")
    return data


def generate_row(prompt: Any, orbit_url: str, ref_url: str, atol: float) -> dict[str, Any]:
    row: dict[str, Any] = {"name": prompt.name, "request": "generate",
                           "num_prompt_tokens": len(prompt.ids), "fresh": list(prompt.fresh),
                           "expected": {"num_reused_tokens": prompt.expect_reused,
                                        "num_hole_tokens": prompt.expect_holes}}
    try:
        got = complete(orbit_url, prompt.ids, EXACT_ONLY, max_tokens=MAX_TOKENS, logprobs=1)
        want = complete(ref_url, prompt.ids, None, max_tokens=MAX_TOKENS, logprobs=1)
    except (RuntimeError, OSError) as exc:
        return {**row, "error": f"{type(exc).__name__}: {exc}", "ok": False}
    tokens, ref_tokens = first_choice(got).get("token_ids"), first_choice(want).get("token_ids")
    diff = max_diff(token_logprobs(got), token_logprobs(want))
    served = served_summary(got)
    checks = {
        "tokens_equal": tokens is not None and tokens == ref_tokens,
        "logprobs_within_atol": diff is not None and diff <= atol,
        "prefix_run_served": served["num_reused_tokens"] >= prompt.expect_reused,
        "holes_served": served["num_hole_tokens"] >= prompt.expect_holes,
        "no_failed_loads": served["num_failed_load_tokens"] == 0,
    }
    return {**row, "served": served, "tokens": tokens, "reference_tokens": ref_tokens,
            "num_distinct_tokens": len(set(ref_tokens or ())), "max_abs_logprob_diff": diff,
            **checks, "ok": all(checks.values())}


def prompt_logprobs_row(prompt: Any, orbit_url: str, ref_url: str, atol: float) -> dict[str, Any]:
    row: dict[str, Any] = {"name": prompt.name, "request": "prompt_logprobs",
                           "num_prompt_tokens": len(prompt.ids), "fresh": list(prompt.fresh),
                           "expected": {"num_reused_tokens": 0, "num_hole_tokens": 0}}
    try:
        got = complete(orbit_url, prompt.ids, {**EXACT_ONLY, "save": False}, max_tokens=1,
                       prompt_logprobs=0)
        want = complete(ref_url, prompt.ids, None, max_tokens=1, prompt_logprobs=0)
    except (RuntimeError, OSError) as exc:
        return {**row, "error": f"{type(exc).__name__}: {exc}", "ok": False}
    (ours, num_wrong), (ref, _) = prompt_logprobs(got), prompt_logprobs(want)
    diff = max_diff(ours, ref)
    served = served_summary(got)
    checks = {
        "prompt_logprobs_within_atol": diff is not None and diff <= atol,
        "served_nothing": served["num_reused_tokens"] == 0 and served["num_hole_tokens"] == 0,
    }
    return {**row, "served": served, "num_positions": len(ours), "num_reference_positions": len(ref),
            "num_positions_without_the_prompt_token": num_wrong,
            "max_abs_prompt_logprob_diff": diff, **checks, "ok": all(checks.values())}


def served_summary(data: dict[str, Any]) -> dict[str, Any]:
    """What OrbitKV reports it served (``kv_transfer_params["orbitkv"]`` of the response)."""
    summary = (data.get("kv_transfer_params") or {}).get("orbitkv") or {}
    return {
        "num_reused_tokens": int(summary.get("num_reused_tokens", 0)),
        "reused_tokens_by_mode": summary.get("reused_tokens_by_mode", {}),
        "num_hole_tokens": int(summary.get("num_hole_tokens", 0)),
        "num_failed_load_tokens": int(summary.get("num_failed_load_tokens", 0)),
        "has_summary": bool(summary),
    }


def prompt_logprobs(data: dict[str, Any]) -> tuple[list[float | None], int]:
    """The logprob of each prompt token (None where vLLM gives none: the first), and how many
    positions hold logprobs of other tokens only (None there too)."""
    choice = first_choice(data)
    ids = choice.get("prompt_token_ids") or data.get("prompt_token_ids") or []
    out: list[float | None] = []
    num_wrong = 0
    for token, entry in zip(ids, choice.get("prompt_logprobs") or [], strict=False):
        value = None if entry is None else entry.get(str(token))
        num_wrong += entry is not None and value is None
        out.append(None if value is None else float(value["logprob"]))
    return out, num_wrong


def max_diff(a: list[float | None], b: list[float | None]) -> float | None:
    """Max ``|a - b|``; None (not comparable) when the lists are empty, differ in length, or
    differ in where a value is missing."""
    if len(a) != len(b) or not a:
        return None
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if (x is None) != (y is None):
            return None
        if x is not None:
            worst = max(worst, abs(x - y))
    return worst


def first_choice(data: dict[str, Any]) -> dict[str, Any]:
    return (data.get("choices") or [{}])[0]


def token_logprobs(data: dict[str, Any]) -> list[float | None]:
    return list((first_choice(data).get("logprobs") or {}).get("token_logprobs") or [])
