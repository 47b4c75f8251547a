"""The routing front: picks a replica by what it holds and forwards the request there; with nothing
to tell the replicas apart it forwards to the fleet's router (vllm-router), whose default policy
(consistent hash on ``X-Session-ID``) decides.

vllm-router 0.1.17 has no hook for an outside scorer (its own ``kv_aware`` policy reads vLLM's
prefix events only), so the chosen replica is reached by this front itself; everything else
(retries, circuit breaking, health) stays the router's, on the fallback path.

Per request: the prompt's token ids, from the front's own tokenizer where it has one
(``local_tokenizer.py``: checked against a replica first) or a replica's ``/tokenize`` (the same
chat template the replica applies), the ranking (``ChunkSetScorer`` or ``PrefixIndex``), then ``decide``:

- each replica's cost is the prompt's tokens it would still compute (its score is the tokens its
  tiers save, weighted by tier) plus ``load_weight`` times the prompt tokens this front has in
  flight to it (requests it forwarded there that have not finished: work queued ahead). The
  cheapest replica is chosen when some replica holds anything and no other costs the same; with
  nothing in flight this is the best score, and a replica that holds the most but is busy loses
  the request to one that would compute more but start at once (llm-d weighs its prefix scorer
  against its queue scorer the same way);
- otherwise the fallback (``no_holdings``: nothing known anywhere, e.g. after lost events or a
  restart; ``tie``: the same cost, e.g. chunks held in Redis only; ``tokenize_failed``);
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
import threading
from collections.abc import Mapping, Sequence
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


def decide(ranking: Sequence[Any], num_tokens: int, queued_tokens: Mapping[str, int],
           load_weight: float) -> tuple[str | None, str]:
    """``(replica, "scored")`` or ``(None, reason)`` from a ranking (``Score``s) of a prompt of
    ``num_tokens``, given the prompt tokens in flight to each replica (see the module doc)."""
    if not ranking or max(s.score for s in ranking) <= 0:
        return None, "no_holdings"
    costs = sorted((num_tokens - s.score + load_weight * queued_tokens.get(s.replica, 0), s.replica)
                   for s in ranking)
    if len(costs) > 1 and costs[1][0] <= costs[0][0]:
        return None, "tie"
    return costs[0][1], "scored"


class InFlight:
    """Prompt tokens this front has forwarded to each replica and not yet seen answered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, int] = {}

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._tokens)

    def begin(self, replica: str, num_tokens: int) -> None:
        with self._lock:
            self._tokens[replica] = self._tokens.get(replica, 0) + num_tokens

    def end(self, replica: str, num_tokens: int) -> None:
        with self._lock:
            left = self._tokens.get(replica, 0) - num_tokens
            if left > 0:
                self._tokens[replica] = left
            else:
                self._tokens.pop(replica, None)


class RoutingFront:
    # Locally tokenized requests checked against a replica's /tokenize before it is trusted.
    NUM_TOKENIZER_CHECKS = 3

    def __init__(self, scorer: Any, replicas: Sequence[str], fallback_url: str, policy: str,
                 feed: Any = None, timeout_s: float = 600.0, tokenize_timeout_s: float = 5.0,
                 load_weight: float = 1.0, tokenizer: Any = None) -> None:
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        self.scorer = scorer
        self.replicas = list(replicas)
        self.fallback_url = fallback_url
        self.policy = policy
        self.load_weight = float(load_weight)
        self.in_flight = InFlight()
        # The front's own tokenizer (``local_tokenizer.LocalTokenizer``) or None: a replica's.
        self.tokenizer = tokenizer
        self._num_tokenizer_checks = 0
        self.timeout_s = timeout_s
        self.tokenize_timeout_s = tokenize_timeout_s
        self.registry = CollectorRegistry()
        self.decisions = Counter("orbitkv_router_decisions", "Requests sent to a replica by score",
                                 ["policy", "replica"], registry=self.registry)
        self.fallbacks = Counter("orbitkv_router_fallbacks", "Requests left to the router's "
                                 "default policy, by reason", ["policy", "reason"], registry=self.registry)
        self.forward_errors = Counter("orbitkv_router_forward_errors", "Forwards that got no "
                                      "answer, by target", ["target"], registry=self.registry)
        self.tokenized = Counter("orbitkv_router_tokenize", "Prompts tokenized, by source (local: "
                                 "the front's own tokenizer; replica: /tokenize; checked: a local "
                                 "result equal to the replica's; mismatch: one that differed, which "
                                 "turned the local tokenizer off)",
                                 ["source"], registry=self.registry)
        if feed is not None:
            self.registry.register(_FeedCollector(feed))

    def metrics(self) -> bytes:
        return generate_latest(self.registry)

    # -- the decision ----------------------------------------------------------------------------

    def tokenize(self, path: str, body: dict[str, Any]) -> list[int] | None:
        tokenizer = self.tokenizer  # another request's mismatch may turn it off meanwhile
        local = self._tokenize_locally(tokenizer, path, body)
        if local is not None and self._num_tokenizer_checks >= self.NUM_TOKENIZER_CHECKS:
            self.tokenized.labels("local").inc()
            return local
        remote = self._tokenize_on_replica(path, body)
        if remote is not None:
            self.tokenized.labels("replica").inc()
        if local is not None and remote is not None:
            if local == remote:
                self._num_tokenizer_checks += 1
                self.tokenized.labels("checked").inc()
            else:
                logger.warning("OrbitKV routing: the local tokenizer (%s) differs from the replicas' "
                               "/tokenize (%d vs %d tokens); tokenizing on a replica from now on",
                               tokenizer.path, len(local), len(remote))
                self.tokenized.labels("mismatch").inc()
                self.tokenizer = None
        return remote

    @staticmethod
    def _tokenize_locally(tokenizer: Any, path: str, body: dict[str, Any]) -> list[int] | None:
        if tokenizer is None:
            return None
        try:
            return tokenizer.encode(path, body)
        except Exception as exc:  # a template that cannot render this request: a replica can
            logger.debug("OrbitKV routing: local tokenization failed: %r", exc)
            return None

    def _tokenize_on_replica(self, path: str, body: dict[str, Any]) -> list[int] | None:
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

    def choose(self, path: str, body: dict[str, Any]) -> tuple[str | None, str, int]:
        """``(replica, "scored", num_tokens)`` or ``(None, reason, num_tokens)``: the fallback
        decides."""
        token_ids = self.tokenize(path, body)
        if token_ids is None:
            return None, "tokenize_failed", 0
        ranking = self.scorer.score_tokens(self.replicas, token_ids)
        replica, reason = decide(ranking, len(token_ids), self.in_flight.snapshot(), self.load_weight)
        return replica, reason, len(token_ids)

    # -- forwarding ------------------------------------------------------------------------------

    def handle(self, handler: Any, path: str, raw: bytes) -> None:
        headers = {k: v for k, v in handler.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        replica, reason, num_tokens = ((None, "bad_body", 0) if not isinstance(body, dict)
                                       else self.choose(path, body))
        if replica is not None:
            self.in_flight.begin(replica, num_tokens)
            try:
                is_relayed = _relay(handler, replica, path, raw, headers, self.timeout_s)
            finally:
                self.in_flight.end(replica, num_tokens)
            if is_relayed:
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
