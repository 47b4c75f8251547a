"""Drive a workload (``workload.py``) through one running vLLM server and account for every step.

Per step it records the client's time to first token, vLLM's own (scheduled -> first token), the
prompt tokens, and where each prompt token came from:

- ``computed``: prefilled by the model (``vllm:prompt_tokens_by_source{source=local_compute}``);
- ``apc``: vLLM's own prefix cache (``local_cache_hit``);
- ``connector``: loaded by the KV connector, OrbitKV here (``external_kv_transfer``);
- ``reused_by_mode``: the connector's own split of its tokens (exact / survivor / patched /
  blind), from the response's ``kv_transfer_params["orbitkv"]["reused_tokens_by_mode"]``.

The source split comes from ``/metrics`` deltas around each request; requests are sent one at a
time, so a delta belongs to one request. Where ``/metrics`` is missing, the usage's
``prompt_tokens_details.cached_tokens`` gives reused vs computed without the split.
Nothing is estimated: a field that the server did not report is ``None``.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orbitkv.agent.floors import by_kind, total
from orbitkv.agent.workload import Step, Workload, chat_body, make_workload
from orbitkv.serving.http_client import ChatResult, metrics_delta, scrape_metrics, timed_chat

SRC = "vllm:prompt_tokens_by_source_total{source=%s}"
NO_CONNECTOR = {"orbitkv": {"load": False, "save": False}}


@dataclass
class StepRecord:
    step: int
    kind: str
    note: str
    images: list[int]
    prompt_tokens: int | None
    computed_tokens: int | None
    apc_tokens: int | None
    connector_tokens: int | None
    reused_by_mode: dict[str, int] | None  # the connector's own report; None when not returned
    ttft_s: float
    engine_ttft_s: float | None
    latency_s: float
    answer: str
    orbitkv: dict[str, Any] | None = None  # the raw kv_transfer_params["orbitkv"] summary
    episode: int = 0
    # vLLM's encoder inputs for this request, from its iteration log; None: not known.
    encoder_items_run: int | None = None
    # ... and for the requests that registered the step's new images first (None: none sent).
    encoder_items_registered: int | None = None
    sent_at_unix_s: float | None = None  # when the request was sent (orders the arms' requests)
    # The step's floors (``floors.py``), counted from the trace after the run.
    exact_floor_tokens: int | None = None
    content_floor_tokens: int | None = None
    num_new_images: int | None = None
    # OrbitKV's seconds per part of its steps for this request (``connector/timing.py``).
    connector_seconds: dict[str, float] | None = None
    # vLLM's own: queued in the engine -> scheduled (the steps it waited before its first).
    engine_queue_s: float | None = None

    @property
    def reused_tokens(self) -> int | None:
        if self.apc_tokens is None and self.connector_tokens is None:
            return None
        return (self.apc_tokens or 0) + (self.connector_tokens or 0)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["reused_tokens"] = self.reused_tokens
        return out


def account(result: ChatResult, delta: dict[str, float] | None) -> dict[str, Any]:
    """Token accounting for one request from its result and the ``/metrics`` delta around it."""
    computed = apc = connector = None
    if delta and any(k.startswith("vllm:prompt_tokens_by_source_total") for k in delta):
        computed = int(delta.get(SRC % "local_compute", 0))
        apc = int(delta.get(SRC % "local_cache_hit", 0))
        connector = int(delta.get(SRC % "external_kv_transfer", 0))
    elif result.prompt_tokens is not None and result.cached_tokens is not None:
        computed = result.prompt_tokens - result.cached_tokens
    summary = (result.kv_transfer_params or {}).get("orbitkv")
    by_mode = None
    if isinstance(summary, dict) and isinstance(summary.get("reused_tokens_by_mode"), dict):
        by_mode = {str(k): int(v) for k, v in summary["reused_tokens_by_mode"].items() if v}
    seconds = None
    if delta:
        prefix = "vllm:orbitkv_seconds_total{part="
        seconds = {k[len(prefix):-1]: round(v, 6) for k, v in delta.items() if k.startswith(prefix) and v}
    return {
        "computed_tokens": computed,
        "apc_tokens": apc,
        "connector_tokens": connector,
        "reused_by_mode": by_mode,
        "orbitkv": summary if isinstance(summary, dict) else None,
        "connector_seconds": seconds or None,
    }


class IterationLog:
    """A vLLM server's per-iteration log lines (``--enable-logging-iteration-details``), which
    count the encoder inputs vLLM ran: the same count for every arm, with or without OrbitKV."""

    _LINE = re.compile(r"Iteration\(\d+\): \d+ context requests, (\d+) context tokens,([^\n]*)")
    _ENCODER = re.compile(r"encoder inputs: (\d+)")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def offset(self) -> int | None:
        try:
            return self.path.stat().st_size
        except OSError:
            return None

    def encoder_inputs(self, start: int, computed_tokens: int | None, timeout_s: float = 3.0) -> int | None:
        """Encoder inputs of the iterations logged since ``start`` (one request in flight), once
        their prompt tokens add up to the request's ``computed_tokens``; None when they do not
        within ``timeout_s``. vLLM logs an iteration in the pass that hands its outputs to the
        request, so the lines are there when the response is; the wait only guards that."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with open(self.path, "rb") as f:
                    f.seek(start)
                    text = f.read().decode(errors="replace")
            except OSError:
                return None
            lines = self._LINE.findall(text)
            num_tokens = sum(int(t) for t, _ in lines)
            if lines and (computed_tokens is None or num_tokens >= computed_tokens):
                return sum(int(m[1]) for _, rest in lines for m in self._ENCODER.finditer(rest))
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def send_step(
    base_url: str,
    body: dict[str, Any],
    step: Step,
    *,
    episode: int = 0,
    iteration_log: IterationLog | None = None,
) -> StepRecord:
    try:
        before = scrape_metrics(base_url)
    except OSError:
        before = None
    log_start = iteration_log.offset() if iteration_log is not None else None
    sent_at = time.time()
    result = timed_chat(base_url, body)
    try:
        delta = metrics_delta(before, scrape_metrics(base_url)) if before is not None else None
    except OSError:
        delta = None
    acc = account(result, delta)
    encoder = None
    if iteration_log is not None and log_start is not None:
        encoder = iteration_log.encoder_inputs(log_start, acc["computed_tokens"])
    return StepRecord(
        step=step.index,
        kind=step.kind,
        note=step.note,
        images=list(step.images),
        prompt_tokens=result.prompt_tokens,
        ttft_s=result.ttft_s,
        engine_ttft_s=result.engine_ttft_s,
        engine_queue_s=result.engine_queue_s,
        latency_s=result.latency_s,
        answer=result.text,
        episode=episode,
        encoder_items_run=encoder,
        sent_at_unix_s=sent_at,
        **acc,
    )


def warm_up(base_url: str, model: str, workload: Workload, *, connector: bool) -> None:
    """One request that shares nothing with the trace (other images, other system text), so the
    first measured step does not pay for vLLM's first-request set-up. It bypasses the connector."""
    w = make_workload(seed=workload.seed + 10_000, window=workload.window, num_steps=2,
                      reorder_at=-1, recall_at=-1, image_size=workload.image_size, obs_words=workload.obs_words)
    w = dataclasses.replace(w, system_text="Warm-up request: answer anything.")
    body = chat_body(w, w.steps[0], model, max_tokens=1, kv_transfer_params=NO_CONNECTOR if connector else None)
    timed_chat(base_url, body)


def run_trace(
    base_url: str,
    model: str,
    workload: Workload,
    *,
    max_tokens: int = 1,
    stream: bool = False,
    kv_transfer_params: dict[str, Any] | None = None,
    episode: int = 0,
    on_step: Any = None,
    register: bool = False,
    iteration_log: IterationLog | None = None,
) -> list[StepRecord]:
    """Send each step; with ``register``, first canonicalize the step's new images (like an agent
    registering a screenshot when it arrives: untimed, before the step's request).
    ``iteration_log``: the server's log, for the encoder inputs each request ran."""
    records = []
    window = None
    if register:
        from orbitkv.agent.workload import image_png
        from orbitkv.client import AgentWindow

        window = AgentWindow(base_url, model, max_tokens=1, session=workload.session)
    for step in workload.steps:
        registered = None
        if window is not None:
            start = iteration_log.offset() if iteration_log is not None and step.new_images else None
            for image_id in step.new_images:
                key = f"{workload.seed}:{image_id}"
                window.add_item(key, image=image_png(workload.seed, image_id, workload.image_size))
                outcome = window.register(key)
                if outcome.get("status") == "error":
                    raise RuntimeError(f"registering image {image_id}: {outcome.get('error')}")
            # The encoder work registration moved ahead of the step (its requests are answered,
            # so their iterations are logged).
            registered = 0 if not step.new_images else (
                None if start is None or iteration_log is None else iteration_log.encoder_inputs(start, None))
        body = chat_body(workload, step, model, max_tokens=max_tokens, stream=stream,
                         kv_transfer_params=kv_transfer_params)
        rec = send_step(base_url, body, step, episode=episode, iteration_log=iteration_log)
        rec.encoder_items_registered = registered
        records.append(rec)
        if on_step is not None:
            on_step(rec)
    return records


# -- summaries -----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class SystemSummary:
    system: str
    num_requests: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_mean_s: float | None
    engine_ttft_p50_s: float | None
    prompt_tokens: int | None
    prefill_tokens_computed: int | None
    apc_tokens: int | None
    connector_tokens: int | None
    reused_tokens_by_mode: dict[str, int] = field(default_factory=dict)
    exact_floor_tokens: int | None = None
    content_floor_tokens: int | None = None
    encoder_items_run: int | None = None
    by_kind: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None
    engine_queue_p50_s: float | None = None
    engine_queue_max_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(system: str, records: list[StepRecord], error: str | None = None) -> SystemSummary:
    ttfts = [r.ttft_s for r in records]
    engine = [r.engine_ttft_s for r in records if r.engine_ttft_s is not None]
    queued = [r.engine_queue_s for r in records if r.engine_queue_s is not None]
    by_mode: dict[str, int] = {}
    apc = total([r.apc_tokens for r in records])
    if apc:
        by_mode["apc_prefix"] = apc
    for r in records:
        for mode, n in (r.reused_by_mode or {}).items():
            by_mode[mode] = by_mode.get(mode, 0) + n
    return SystemSummary(
        system=system,
        num_requests=len(records),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else None,
        engine_ttft_p50_s=percentile(engine, 50),
        engine_queue_p50_s=percentile(queued, 50),
        engine_queue_max_s=max(queued) if queued else None,
        prompt_tokens=total([r.prompt_tokens for r in records]),
        prefill_tokens_computed=total([r.computed_tokens for r in records]),
        apc_tokens=apc,
        connector_tokens=total([r.connector_tokens for r in records]),
        reused_tokens_by_mode=by_mode,
        exact_floor_tokens=total([r.exact_floor_tokens for r in records]),
        content_floor_tokens=total([r.content_floor_tokens for r in records]),
        encoder_items_run=total([r.encoder_items_run for r in records]),
        by_kind=by_kind(records),
        error=error,
    )


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b
