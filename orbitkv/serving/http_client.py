"""HTTP calls to a running vLLM OpenAI server, for the drivers, benches and checks: health and
JSON requests, ``/metrics`` scraped and diffed, a timed chat completion (time to the first token,
usage and OrbitKV's report), ``/tokenize``, ``/reset_prefix_cache`` (dev mode)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


def _conn(base_url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(base_url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout)


def http_get(base_url: str, path: str, timeout: float = 10.0) -> tuple[int, str]:
    conn = _conn(base_url, timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def http_post_json(
    base_url: str, path: str, body: Mapping[str, Any], timeout: float = 600.0
) -> tuple[int, Any]:
    """POST ``body`` as JSON: the status and the decoded answer (its text when it is not JSON)."""
    conn = _conn(base_url, timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
    finally:
        conn.close()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


# Labels a scrape keeps apart: vLLM's prompt-token source, OrbitKV's per-part seconds.
KEPT_LABELS = ("source", "part")


def scrape_metrics(base_url: str) -> dict[str, float]:
    """The server's Prometheus counters, summed over label sets except those in ``KEPT_LABELS``.

    Keys: ``name`` for unlabelled sums, ``name{source=...}`` / ``name{part=...}`` for the rest.
    """
    status, text = http_get(base_url, "/metrics")
    if status != 200:
        return {}
    return parse_prometheus(text)


def label_totals(text: str, sample: str, label: str) -> dict[str, float]:
    """``sample``'s values (a counter's ``..._total``) in Prometheus ``text``, summed by ``label``'s
    value over every other label."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def scraped_label_totals(base_url: str, sample: str, label: str) -> dict[str, float]:
    """``label_totals`` of a server's ``/metrics``; empty while it does not answer."""
    try:
        status, text = http_get(base_url, "/metrics")
    except OSError:
        return {}
    return label_totals(text, sample, label) if status == 200 else {}


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            head, value = line.rsplit(" ", 1)
            number = float(value)
        except ValueError:
            continue
        name, _, labels = head.partition("{")
        if not name.startswith("vllm:"):
            continue
        key = name
        for part in labels.rstrip("}").split(","):
            k, _, v = part.partition("=")
            if k.strip() in KEPT_LABELS:
                key = f"{name}{{{k.strip()}={v.strip().strip(chr(34))}}}"
        out[key] = out.get(key, 0.0) + number
    return out


def tokenize_chat(base_url: str, model: str, messages: list[dict[str, Any]], timeout: float = 120.0) -> list[int] | None:
    """The prompt token ids of a chat as the server would build it (``/tokenize``, images expanded
    to their placeholder tokens); None if the server refuses it."""
    conn = _conn(base_url, timeout)
    try:
        body = {"model": model, "messages": messages, "add_generation_prompt": True}
        conn.request("POST", "/tokenize", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read() or b"{}")
    except (OSError, ValueError):
        return None
    finally:
        conn.close()
    return [int(t) for t in data["tokens"]] if resp.status == 200 and "tokens" in data else None


def metrics_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


@dataclass
class ChatResult:
    ttft_s: float  # client side: request sent -> first token (see module docstring)
    latency_s: float
    text: str
    prompt_tokens: int | None
    cached_tokens: int | None  # vLLM: local prefix-cache hits + connector-loaded tokens
    engine_ttft_s: float | None  # vLLM's own: scheduled -> first token
    kv_transfer_params: dict[str, Any] | None
    streamed: bool
    # vLLM's own: queued in the engine -> scheduled. Steps a request waits there (a KV load, a
    # connector's "ask again") count here and not in ``engine_ttft_s``.
    engine_queue_s: float | None = None
    # The first generated token's top logprobs (token text -> logprob), when the request asked
    # for ``logprobs`` with ``top_logprobs`` (non-streaming only).
    first_top_logprobs: dict[str, float] | None = None


def timed_chat(
    base_url: str,
    body: Mapping[str, Any],
    timeout: float = 600.0,
    headers: Mapping[str, str] | None = None,
) -> ChatResult:
    """POST ``/v1/chat/completions`` and time it; raises ``RuntimeError`` on an HTTP error.
    ``headers`` go with the request (a router's ``X-Session-ID``)."""
    payload = json.dumps(body).encode()
    stream = bool(body.get("stream"))
    conn = _conn(base_url, timeout)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", payload,
                     {"Content-Type": "application/json", **dict(headers or {})})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from {base_url}: {resp.read().decode(errors='replace')[:2000]}")
        if not stream:
            data = json.loads(resp.read())
            t1 = time.perf_counter()
            return _result_from_full(data, t1 - t0)
        return _read_stream(resp, t0)
    finally:
        conn.close()


def _usage_fields(usage: Mapping[str, Any] | None) -> tuple[int | None, int | None]:
    if not usage:
        return None, None
    details = usage.get("prompt_tokens_details") or {}
    return usage.get("prompt_tokens"), details.get("cached_tokens")


def _metric_s(metrics: Mapping[str, Any] | None, name: str) -> float | None:
    value = (metrics or {}).get(name)
    return None if value is None else float(value) / 1000.0


def _result_from_full(data: Mapping[str, Any], latency_s: float) -> ChatResult:
    choices = data.get("choices") or [{}]
    text = (choices[0].get("message") or {}).get("content") or ""
    prompt_tokens, cached = _usage_fields(data.get("usage"))
    return ChatResult(
        ttft_s=latency_s,
        latency_s=latency_s,
        text=text,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        engine_ttft_s=_metric_s(data.get("metrics"), "time_to_first_token_ms"),
        kv_transfer_params=data.get("kv_transfer_params"),
        streamed=False,
        engine_queue_s=_metric_s(data.get("metrics"), "queue_time_ms"),
        first_top_logprobs=_first_top_logprobs(choices[0].get("logprobs")),
    )


def _first_top_logprobs(logprobs: Mapping[str, Any] | None) -> dict[str, float] | None:
    content = (logprobs or {}).get("content") or []
    if not content:
        return None
    return {str(t["token"]): float(t["logprob"]) for t in content[0].get("top_logprobs") or ()}


def _read_stream(resp: http.client.HTTPResponse, t0: float) -> ChatResult:
    ttft = None
    text: list[str] = []
    usage = metrics = None
    for raw in resp:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            piece = delta.get("content")
            if (piece or choice.get("finish_reason")) and ttft is None:
                ttft = time.perf_counter() - t0
            if piece:
                text.append(piece)
        usage = chunk.get("usage") or usage
        metrics = chunk.get("metrics") or metrics
    latency = time.perf_counter() - t0
    prompt_tokens, cached = _usage_fields(usage)
    return ChatResult(
        ttft_s=latency if ttft is None else ttft,
        latency_s=latency,
        text="".join(text),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        engine_ttft_s=_metric_s(metrics, "time_to_first_token_ms"),
        kv_transfer_params=None,
        streamed=True,
        engine_queue_s=_metric_s(metrics, "queue_time_ms"),
    )


def first_model_id(base_url: str) -> str:
    status, text = http_get(base_url, "/v1/models")
    if status != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {status}")
    return json.loads(text)["data"][0]["id"]


def reset_prefix_cache(base_url: str) -> bool:
    """Empty vLLM's own prefix cache (not the connector's store); needs ``dev_mode``."""
    conn = _conn(base_url, 30.0)
    try:
        conn.request("POST", "/reset_prefix_cache")
        resp = conn.getresponse()
        body = resp.read().decode(errors="replace")
        return resp.status == 200 and json.loads(body).get("success", False)
    finally:
        conn.close()
