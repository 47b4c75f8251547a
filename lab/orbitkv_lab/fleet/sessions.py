"""Agent sessions over a fleet: a text workload, one request at a time, and where each prompt token
came from on the replica that served it.

A session is an agent's conversation: its own system prompt (tools, instructions), then one turn
per step (an observation and a question; the assistant's earlier answers are fixed text, so a
session's prompts do not depend on which replica answered before). Each turn's prompt extends the
previous one, so a replica that served turn t has turn t's prefix in vLLM's prefix cache, and
OrbitKV has its full chunks in the store (memory here, Redis for the fleet).

Accounting is vLLM's own ``vllm:prompt_tokens_by_source_total`` on each replica's ``/metrics``:
``local_cache_hit`` (the replica's prefix cache), ``external_kv_transfer`` (OrbitKV's loads) and
``local_compute``. Requests are sent one at a time, so the replica whose counters moved served it.
"""

from __future__ import annotations

import http.client
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from orbitkv.serving.http_client import scrape_metrics, timed_chat

SRC = "vllm:prompt_tokens_by_source_total{source=%s}"
SOURCES = {"computed": "local_compute", "prefix_cache": "local_cache_hit", "orbitkv": "external_kv_transfer"}
_WORDS = (
    "screen window button click scroll page table row column cell value error retry open close "
    "file folder search result query tool call return status ready wait input output agent plan "
    "step goal check verify submit form field label text image chart report summary update"
).split()


@dataclass(frozen=True)
class Session:
    session_id: str
    system: str
    observations: tuple[str, ...]

    def messages(self, turn: int) -> list[dict[str, str]]:
        """The prompt of ``turn`` (0-based): the system prompt, every earlier turn, this one."""
        out = [{"role": "system", "content": self.system}]
        for t in range(turn + 1):
            out.append({"role": "user", "content": f"{self.observations[t]}\nWhat next?"})
            if t < turn:
                out.append({"role": "assistant", "content": f"Step {t}: done."})
        return out


def make_sessions(num_sessions: int, num_turns: int, *, system_words: int = 220,
                  turn_words: int = 90, seed: int = 0, prefix: str = "agent") -> list[Session]:
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    return [
        Session(f"{prefix}-{seed}-{i}", f"You are {prefix} {i}. Tools: {text(system_words)}",
                tuple(f"Observation {t}: {text(turn_words)}" for t in range(num_turns)))
        for i in range(num_sessions)
    ]


def chat_body(model: str, messages: list[dict[str, str]], *, max_tokens: int,
              cache_salt: str | None = None, tenant: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if tenant is not None:
        body["kv_transfer_params"] = {"orbitkv": {"tenant": tenant}}
    return body


@dataclass
class Reply:
    replica: int | None  # index into the replica list; None: no counter moved
    ttft_s: float
    latency_s: float
    text: str
    prompt_tokens: int
    computed_tokens: int
    prefix_cache_tokens: int
    orbitkv_tokens: int
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def source_counts(url: str) -> dict[str, float]:
    """The replica's prompt-token counters by source; zeros while it is down (restarting)."""
    try:
        metrics = scrape_metrics(url)
    except (OSError, http.client.HTTPException):
        metrics = {}
    return {name: metrics.get(SRC % src, 0.0) for name, src in SOURCES.items()}


def send(url: str, body: Mapping[str, Any], replicas: Sequence[str], *,
         headers: Mapping[str, str] | None = None, settle_s: float = 5.0,
         timeout_s: float = 120.0) -> Reply:
    """One streamed request to ``url`` (a replica or the router). Its accounting is the delta of
    the replicas' counters, waited for until they add up to the request's prompt tokens."""
    before = [source_counts(r) for r in replicas]
    try:
        res = timed_chat(url, body, timeout=timeout_s, headers=headers)
    except (OSError, RuntimeError) as exc:
        return Reply(None, 0.0, 0.0, "", 0, 0, 0, 0, error=str(exc)[:500])
    prompt_tokens = int(res.prompt_tokens or 0)
    deadline = time.monotonic() + settle_s
    while True:
        deltas = []
        for r, b in zip(replicas, before, strict=True):
            after = source_counts(r)
            deltas.append({k: int(after[k] - b[k]) for k in after})
        moved = [i for i, d in enumerate(deltas) if sum(d.values())]
        if (len(moved) == 1 and sum(deltas[moved[0]].values()) == prompt_tokens) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    replica = moved[0] if len(moved) == 1 else None
    d = deltas[replica] if replica is not None else {k: 0 for k in SOURCES}
    return Reply(replica, res.ttft_s, res.latency_s, res.text, prompt_tokens,
                 d["computed"], d["prefix_cache"], d["orbitkv"])


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
