"""The routing front: picks a replica by what it holds and forwards the request there; with nothing
to tell the replicas apart it forwards to the fleet's router (vllm-router), whose default policy
(consistent hash on ``X-Session-ID``) decides.

vllm-router 0.1.17 has no hook for an outside scorer (its own ``kv_aware`` policy reads vLLM's
prefix events only), so the chosen replica is reached by this front itself; everything else
(retries, circuit breaking, health) stays the router's, on the fallback path.

Per request: the prompt's token ids from a replica's ``/tokenize`` (the same chat template the
replica applies), the ranking (``ChunkSetScorer`` or ``PrefixIndex``), then:

- the best replica when its score is above zero and above the next one's;
- otherwise the fallback (``no_holdings``: nothing known anywhere, e.g. after lost events or a
  restart; ``tie``: the same score, e.g. chunks held in Redis only; ``tokenize_failed``);
- a chosen replica that does not answer (restarting) also falls back (``replica_down``), so a
  request fails only when the router fails it.

``GET /metrics``: Prometheus counters ``orbitkv_router_decisions_total{policy,replica}``,
``orbitkv_router_fallbacks_total{policy,reason}``, ``orbitkv_router_forward_errors_total{target}``,
and from the event feed ``orbitkv_router_events_total{replica,event,medium}``,
``orbitkv_router_event_batches_total{replica}``, ``orbitkv_router_event_gaps_total{replica}``.
"""

from __future__ import annotations

import http.client
import json
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily

logger = logging.getLogger(__name__)
PROXIED_PATHS = ("/v1/chat/completions", "/v1/completions")
FORWARDED_HEADERS = ("content-type", "authorization", "x-session-id", "x-user-id", "x-request-id")
_CHAT_TOKENIZE_KEYS = ("messages", "add_generation_prompt", "continue_final_message",
                       "chat_template", "chat_template_kwargs", "tools")


class _FeedCollector:
    def __init__(self, feed: Any) -> None:
        self._feed = feed

    def collect(self):
        events = CounterMetricFamily("orbitkv_router_events", "KV events received, by replica, "
                                     "event type and medium", labels=["replica", "event", "medium"])
        for (replica, kind, medium), n in sorted(self._feed.events_by_kind.items()):
            events.add_metric([replica, kind, medium], n)
        batches = CounterMetricFamily("orbitkv_router_event_batches", "KV event batches received",
                                      labels=["replica"])
        gaps = CounterMetricFamily("orbitkv_router_event_gaps", "Sequence gaps (lost events or a "
                                   "restarted replica): the replica is forgotten", labels=["replica"])
        for replica, n in sorted(self._feed.batches_by_replica.items()):
            batches.add_metric([replica], n)
        for replica, n in sorted(self._feed.gaps_by_replica.items()):
            gaps.add_metric([replica], n)
        yield from (events, batches, gaps)


class RoutingFront:
    def __init__(self, scorer: Any, replicas: Sequence[str], fallback_url: str, policy: str,
                 feed: Any = None, timeout_s: float = 600.0, tokenize_timeout_s: float = 5.0) -> None:
        self.scorer = scorer
        self.replicas = list(replicas)
        self.fallback_url = fallback_url
        self.policy = policy
        self.timeout_s = timeout_s
        self.tokenize_timeout_s = tokenize_timeout_s
        self.registry = CollectorRegistry()
        self.decisions = Counter("orbitkv_router_decisions", "Requests sent to a replica by score",
                                 ["policy", "replica"], registry=self.registry)
        self.fallbacks = Counter("orbitkv_router_fallbacks", "Requests left to the router's "
                                 "default policy, by reason", ["policy", "reason"], registry=self.registry)
        self.forward_errors = Counter("orbitkv_router_forward_errors", "Forwards that got no "
                                      "answer, by target", ["target"], registry=self.registry)
        if feed is not None:
            self.registry.register(_FeedCollector(feed))

    def metrics(self) -> bytes:
        return generate_latest(self.registry)

    # -- the decision ----------------------------------------------------------------------------

    def tokenize(self, path: str, body: dict[str, Any]) -> list[int] | None:
        if path == "/v1/chat/completions":
            req = {k: body[k] for k in _CHAT_TOKENIZE_KEYS if k in body}
        else:
            req = {"prompt": body.get("prompt")}
        req["model"] = body.get("model")
        data = json.dumps(req).encode()
        for url in self.replicas:
            try:
                status, payload = _post(url, "/tokenize", data, {"Content-Type": "application/json"},
                                        self.tokenize_timeout_s)
            except (OSError, http.client.HTTPException):
                continue
            if status == 200:
                return [int(t) for t in json.loads(payload)["tokens"]]
        return None

    def choose(self, path: str, body: dict[str, Any]) -> tuple[str | None, str]:
        """``(replica, "scored")`` or ``(None, reason)``: the fallback decides."""
        token_ids = self.tokenize(path, body)
        if token_ids is None:
            return None, "tokenize_failed"
        ranking = self.scorer.score_tokens(self.replicas, token_ids)
        if not ranking or ranking[0].score <= 0:
            return None, "no_holdings"
        if len(ranking) > 1 and ranking[1].score >= ranking[0].score:
            return None, "tie"
        return ranking[0].replica, "scored"

    # -- forwarding ------------------------------------------------------------------------------

    def handle(self, handler: Any, path: str, raw: bytes) -> None:
        headers = {k: v for k, v in handler.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        replica, reason = (None, "bad_body") if not isinstance(body, dict) else self.choose(path, body)
        if replica is not None:
            if _relay(handler, replica, path, raw, headers, self.timeout_s):
                self.decisions.labels(self.policy, replica).inc()
                return
            self.forward_errors.labels(replica).inc()
            reason = "replica_down"
        self.fallbacks.labels(self.policy, reason).inc()
        if not _relay(handler, self.fallback_url, path, raw, headers, self.timeout_s):
            self.forward_errors.labels(self.fallback_url).inc()
            handler.send_error(502, "the router does not answer")


def _split(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _post(url: str, path: str, data: bytes, headers: dict[str, str], timeout_s: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*_split(url), timeout=timeout_s)
    try:
        conn.request("POST", path, data, headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _relay(handler: Any, url: str, path: str, raw: bytes, headers: dict[str, str], timeout_s: float) -> bool:
    """Forward and stream the answer back (chunked). False when the target gave no answer at all
    (nothing was sent to the client yet, so the caller may try elsewhere)."""
    conn = http.client.HTTPConnection(*_split(url), timeout=timeout_s)
    try:
        try:
            conn.request("POST", path, raw, headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException):
            return False
        handler.send_response(resp.status)
        handler.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("Connection", "close")
        handler.send_header("X-OrbitKV-Routed-To", url)
        handler.end_headers()
        try:
            while piece := resp.read1(65536):
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException) as exc:
            logger.warning("OrbitKV routing: the stream from %s broke: %s", url, exc)
        handler.close_connection = True
        return True
    finally:
        conn.close()
