"""The printed summary of ``orbitkv bench agent`` (and the parts ``orbitkv demo`` shares): systems,
tokens against both floors per step kind, encoder items, fairness, ratios with their spread."""

from __future__ import annotations

from typing import Any


def fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def floor_lines(systems: dict[str, dict[str, Any]]) -> list[str]:
    """Per system and step kind: tokens computed against the exact and the content floor, and the
    encoder items vLLM ran against the step's new images."""
    lines = [
        "tokens computed against the floors, per step kind (exact: what an exact cache must compute;",
        "content: fresh content only); encoder items run against new images (vLLM's own count;",
        "OrbitKV's in brackets; +N: run by the requests that registered the new images first):",
    ]
    for name, s in systems.items():
        for kind, v in (s.get("by_kind") or {}).items():
            own, registered = v.get("orbitkv_encoded_items"), v.get("encoder_items_registered")
            lines.append(
                f"  {name:<16} {kind:<8} x{v['num_steps']:<3} computed {fmt(v['computed_tokens'], 'd'):>6}  "
                f"exact {fmt(v['exact_floor_tokens'], 'd'):>6} (x{fmt(v['computed_over_exact_floor'], '.2f')})  "
                f"content {fmt(v['content_floor_tokens'], 'd'):>6} (x{fmt(v['computed_over_content_floor'], '.2f')})  "
                f"encoder {fmt(v['encoder_items_run'], 'd')}{'' if own is None else f' [{own}]'}"
                f"{'' if registered is None else f' +{registered} registering'} "
                f"of {fmt(v['num_new_images'], 'd')} new"
            )
    return lines


def fairness_lines(fair: dict[str, Any], withheld: str | None) -> list[str]:
    """The arms' cores as each server logged them, and the identical-work (start) step."""
    check, start = fair["binding_check"], fair["start_step"]
    cores = ", ".join(f"{arm} {c}" for arm, c in check["core_ids"].items())
    lines = [f"cores (read back from each server's log): {cores}"]
    if withheld:
        lines.append(f"  NO RATIOS: {withheld}")
    medians = ", ".join(f"{arm} {fmt(t)} s" for arm, t in start["ttft_median_s"].items())
    lines.append(f"start step (identical work), median TTFT: {medians}; slowest / fastest "
                 f"x{fmt(start['slowest_over_fastest'], '.2f')}")
    if start["is_flagged"]:
        lines.append(f"  FLAGGED: the identical-work step differs by more than x{start['tolerance']} across arms "
                     "(the machine was not steady, or the arms do not run alike): read the ratios with care")
    for arm, same in (fair.get("identical_work") or {}).items():
        r = same["engine_ttft_ratio"]
        if r is None:
            continue
        lines.append(f"same work as {same['reference']} ({same['num_requests']} requests: the tokens and encoder "
                     f"items it computed), engine TTFT {same['reference']} / {arm} median x{r['median']:.3f} "
                     f"[p25 {r['p25']:.3f}, p75 {r['p75']:.3f}]")
    return lines


def format_report(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [
        f"model: {cfg['model']}  trace: {cfg.get('trace', 'basic')}, window {cfg['window']}, "
        f"{cfg['steps']} steps x {cfg['episodes']} episodes",
        "",
        f"{'system':<16} {'ttft_p50_s':>10} {'ttft_p95_s':>10} {'queued_p50_s':>12} {'prefill_computed':>16} "
        f"{'prompt':>7}  reused_tokens_by_mode",
    ]
    for name, s in doc["systems"].items():
        if s.get("error") and not s.get("num_requests"):
            lines.append(f"{name:<16} FAILED: {s['error']}")
            continue
        modes = ", ".join(f"{k} {v}" for k, v in s["reused_tokens_by_mode"].items()) or "-"
        lines.append(
            f"{name:<16} {fmt(s['ttft_p50_s']):>10} {fmt(s['ttft_p95_s']):>10} "
            f"{fmt(s.get('engine_queue_p50_s')):>12} {fmt(s['prefill_tokens_computed'], 'd'):>16} {fmt(s['prompt_tokens'], 'd'):>7}  {modes}"
        )
        if s.get("error"):
            lines.append(f"{'':<16} (incomplete: {s['error']})")
    lines += ["", *floor_lines(doc["systems"])]
    if doc.get("fairness"):
        lines += ["", *fairness_lines(doc["fairness"], doc.get("speedup_withheld"))]
    if doc["speedup"]:
        lines += ["", "ratios, second system over first (above 1: the first is faster; per-episode min..max):"]
        for pair, r in doc["speedup"].items():
            lines.append(
                f"  {pair:<26} ttft_p50 x{fmt(r['ttft_p50'], '.2f')}{_range(r.get('ttft_p50_spread'))}  "
                f"ttft_p95 x{fmt(r['ttft_p95'], '.2f')}  prefill tokens x{fmt(r['prefill_tokens_computed'], '.2f')}"
                f"{_range(r.get('prefill_tokens_spread'))}"
            )
    f = doc.get("floor")
    if f and "error" in f:
        lines += ["", f"per-request floor: FAILED: {f['error']}"]
    elif f:
        lines += [
            "",
            f"per-request floor (step {f['step']} {f['kind']}, {f['prompt_tokens']} prompt tokens, median of {f['repeats']}):",
            f"  all chunks cached (OrbitKV, APC emptied): ttft {fmt(f['all_cached']['ttft_s'])} s, "
            f"computed {f['all_cached']['computed_tokens']}, loaded {f['all_cached']['connector_tokens']} "
            f"{f['all_cached']['reused_tokens_by_mode'] or ''}",
            f"  same request from vLLM's prefix cache:   ttft {fmt(f['prefix_cached']['ttft_s'])} s "
            f"(all cached / this x{fmt(f.get('all_cached_over_prefix_cached'), '.2f')})",
            f"  prefill of the new tokens only:          ttft {fmt(f['new_tokens_only']['ttft_s'])} s "
            f"({f['new_tokens_only']['prompt_tokens']} tokens)",
            f"  full prefill, no cache:                  ttft {fmt(f['full_prefill']['ttft_s'])} s "
            f"(computed {f['full_prefill']['computed_tokens']})",
        ]
        cached = f["all_cached"]
        parts = cached.get("connector_seconds") or {}
        if cached.get("engine_ttft_s") is not None or parts:
            lines.append(
                f"  where the all-cached time goes: engine (scheduled -> first token) "
                f"{fmt(cached.get('engine_ttft_s'))} s; OrbitKV "
                + (", ".join(f"{p} {v * 1e3:.1f} ms" for p, v in sorted(parts.items(), key=lambda x: -x[1])) or "-")
            )
    return "\n".join(lines)


def _range(sp: dict[str, Any] | None) -> str:
    if not sp:
        return ""
    return f" [{fmt(sp['min'], '.2f')}..{fmt(sp['max'], '.2f')}, n={sp['n']}]"
