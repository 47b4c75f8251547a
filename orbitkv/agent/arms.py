"""Arms side by side: every server up first, on the same cores, then the episodes alternating
between them (A, B, C, A, B, C, ...); the floors counted once from the trace, after the run.

Shared by ``orbitkv demo`` and ``orbitkv bench agent``. Between two arms the bench waits until the
last one is quiet (``fairness.wait_quiet``): its writes and vLLM's busy-polling after a request
would otherwise run during the next arm's request. Within an arm nothing waits, so OrbitKV's
background work competes with its own next step, as it would for a real agent sending steps back
to back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from orbitkv.agent import driver as drv
from orbitkv.agent.fairness import (
    compare_bindings,
    identical_work,
    read_binding,
    spread,
    start_step_check,
    wait_quiet,
)
from orbitkv.agent.floors import StepFloors, attach_floors, run_floors, total
from orbitkv.agent.workload import START, Workload
from orbitkv.serving.http_client import first_model_id, tokenize_chat
from orbitkv.serving.server_process import ORBITKV_SYSTEMS, SYSTEM_TITLES, SYSTEMS, VLLMServer

Log = Callable[[str], None]


@dataclass
class Arm:
    system: str
    server: VLLMServer
    is_registering: bool = False  # canonicalize each new image before its step (patches)
    model: str | None = None
    records: list[drv.StepRecord] = field(default_factory=list)
    error: str | None = None
    startup_s: float | None = None
    binding: dict[str, Any] | None = None
    quiet_wait_s: float = 0.0

    @property
    def is_live(self) -> bool:
        return self.error is None and self.model is not None

    @property
    def title(self) -> str:
        return SYSTEM_TITLES[self.system]


def first_error_line(text: str) -> str:
    """The most telling line of a failed start-up log."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ("Error" in ln or "error" in ln) and "errors.pydantic.dev" not in ln:
            return ln[:400]
    return lines[0][:400] if lines else "failed to start"


def image_token_id(model_dir: str | Path) -> int:
    """The image placeholder token of a multimodal model directory (its ``config.json``)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    for key in ("image_token_id", "image_token_index"):
        if isinstance(cfg.get(key), int):
            return int(cfg[key])
    raise ValueError(f"{model_dir}/config.json names no image_token_id")


@contextmanager
def running(arms: Sequence[Arm], workload: Workload, log: Log) -> Iterator[Sequence[Arm]]:
    """Start every arm's server (one after another), read its binding back, warm it up; stop all
    on exit. An arm that fails keeps its error; the others go on."""
    try:
        for arm in arms:
            _start(arm, workload, log)
        for arm in arms:
            if arm.is_live:
                arm.quiet_wait_s += wait_quiet(_sid(arm))
        yield arms
    finally:
        for arm in arms:
            arm.server.stop()


def _sid(arm: Arm) -> int:
    assert arm.server.proc is not None
    return arm.server.proc.pid  # started with start_new_session: its own session id


def _start(arm: Arm, workload: Workload, log: Log) -> None:
    log(f"[{arm.title}] starting vLLM server (log: {arm.server.log_path}) ...")
    t0 = time.monotonic()
    try:
        arm.server.start()
    except (RuntimeError, TimeoutError) as exc:
        arm.error = first_error_line(str(exc))
        log(f"[{arm.title}] FAILED to start: {arm.error}")
        return
    arm.startup_s = round(time.monotonic() - t0, 1)
    arm.binding = read_binding(arm.server.log_path)
    cores = None if arm.binding is None else arm.binding["core_ids"]
    log(f"[{arm.title}] ready in {arm.startup_s} s; OpenMP threads on cores {cores}")
    try:
        arm.model = first_model_id(arm.server.base_url)
        drv.warm_up(arm.server.base_url, arm.model, workload, connector=arm.system in ORBITKV_SYSTEMS)
    except Exception as exc:
        arm.error = f"warm-up: {type(exc).__name__}: {exc}"[:500]
        log(f"[{arm.title}] FAILED: {arm.error}")


def episode_order(arms: Sequence[Arm], episode: int) -> list[Arm]:
    """The arms in the given order on even episodes and reversed on odd ones (A B, B A, ...): the
    machine's drift over an episode pair then weighs on every arm alike, where a fixed order gave
    the first arm the same position, and its share of the drift, every time."""
    return list(arms) if episode % 2 == 0 else list(reversed(arms))


def run_interleaved(arms: Sequence[Arm], workloads: Sequence[Workload], log: Log, *,
                    max_tokens: int = 1, stream: bool = False) -> None:
    """Each episode on every live arm in turn, each arm quiet before the next one starts, in the
    order of ``episode_order``."""
    for episode, w in enumerate(workloads):
        for arm in episode_order(arms, episode):
            if not arm.is_live:
                continue

            def on_step(r: drv.StepRecord, arm: Arm = arm) -> None:
                arm.records.append(r)
                log(f"  [{arm.system}] ep {r.episode} step {r.step} {r.kind:<8} ttft {r.ttft_s:.3f} s "
                    f"computed {r.computed_tokens}/{r.prompt_tokens}")

            try:
                assert arm.model is not None
                drv.run_trace(arm.server.base_url, arm.model, w, max_tokens=max_tokens, stream=stream,
                              episode=episode, register=arm.is_registering, on_step=on_step,
                              iteration_log=drv.IterationLog(arm.server.log_path))
            except Exception as exc:
                arm.error = f"{type(exc).__name__}: {exc}"[:500]
                log(f"[{arm.title}] FAILED: {arm.error}")
            arm.quiet_wait_s += wait_quiet(_sid(arm))


def count_floors(arms: Sequence[Arm], workloads: Sequence[Workload], model_dir: str | Path) -> list[StepFloors]:
    """The run's floors from the first arm that still answers (``/tokenize``), set on every arm's
    records. Tokenizing after the timed run warms no arm's caches for it."""
    for arm in arms:
        if arm.model is None or arm.server.proc is None or arm.server.proc.poll() is not None:
            continue
        floors = run_floors(partial(tokenize_chat, arm.server.base_url, arm.model), workloads,
                            image_token_id(model_dir))
        for a in arms:
            attach_floors(a.records, floors)
        return floors
    raise RuntimeError("no server left to count the floors with")


def fairness(arms: Sequence[Arm], *, is_binding_required: bool) -> dict[str, Any]:
    """The arms' bindings (read back from their logs) and whether they are equal; the
    identical-work step (start steps) across arms; the time spent waiting for quiet; each arm's
    requests that did APC's work, and its engine TTFT there against APC's."""
    started = [a for a in arms if a.startup_s is not None]
    starts = {a.system: [r for r in a.records if r.kind == START] for a in started if a.records}
    return {
        "bindings": {a.system: a.binding for a in started},
        "binding_check": compare_bindings({a.system: a.binding for a in started},
                                          is_required=is_binding_required),
        "start_step": start_step_check({s: [r.ttft_s for r in rs] for s, rs in starts.items()},
                                       {s: [r.computed_tokens for r in rs] for s, rs in starts.items()}),
        "quiet_wait_s": {a.system: round(a.quiet_wait_s, 2) for a in started},
        "identical_work": identical_work({a.system: a.records for a in started}),
    }


def episode_ratios(slow: Sequence[drv.StepRecord], fast: Sequence[drv.StepRecord]) -> dict[str, Any]:
    """Per episode: slow / fast for TTFT p50 and tokens computed; and their spread."""
    ttft, tokens = [], []
    for e in sorted({r.episode for r in fast} & {r.episode for r in slow}):
        a = [r for r in fast if r.episode == e]
        b = [r for r in slow if r.episode == e]
        ttft.append(drv.ratio(drv.percentile([r.ttft_s for r in b], 50), drv.percentile([r.ttft_s for r in a], 50)))
        tokens.append(drv.ratio(total([r.computed_tokens for r in b]), total([r.computed_tokens for r in a])))
    return {"ttft_p50_per_episode": ttft, "ttft_p50_spread": spread(ttft),
            "prefill_tokens_per_episode": tokens, "prefill_tokens_spread": spread(tokens)}


def speedups(summaries: dict[str, dict[str, Any]], records: dict[str, list[drv.StepRecord]] | None = None,
             ) -> dict[str, dict[str, Any]]:
    """For each pair (fast, slow) in ``SYSTEMS`` order: slow / fast for TTFT p50, p95 and prefill
    tokens over the whole run, and with ``records`` the per-episode ratios and their spread."""
    out = {}
    names = [s for s in SYSTEMS if s in summaries and not summaries[s].get("error")]
    for i, fast in enumerate(names):
        for slow in names[i + 1 :]:
            a, b = summaries[fast], summaries[slow]
            out[f"{fast}_vs_{slow}"] = {
                "ttft_p50": drv.ratio(b["ttft_p50_s"], a["ttft_p50_s"]),
                "ttft_p95": drv.ratio(b["ttft_p95_s"], a["ttft_p95_s"]),
                "prefill_tokens_computed": drv.ratio(b["prefill_tokens_computed"], a["prefill_tokens_computed"]),
                **(episode_ratios(records[slow], records[fast]) if records else {}),
            }
    return out


def compare_systems(summaries: dict[str, dict[str, Any]], records: dict[str, list[drv.StepRecord]] | None,
                    binding_check: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], str | None]:
    """(speedups, None) when every arm computed on the same cores, else ({}, why not)."""
    if not binding_check["is_equal"]:
        return {}, binding_check["reason"]
    return speedups(summaries, records), None
