"""A tiny ranking service around ``ChunkSetScorer``: it subscribes to each replica's vLLM KV event
publisher (``--kv-events-config``, ZMQ) and answers ``POST /rank`` for a router in front.

    python -m orbitkv.routing.service --block-size 32 --port 8100 \\
        --replica http://replica-a:8000=tcp://replica-a:5557 \\
        --replica http://replica-b:8000=tcp://replica-b:5557

``POST /rank`` with ``{"token_ids": [...], "block_hashes": [...]}`` (``block_hashes``: optional,
the request's, as vLLM hashes them) answers ``{"ranking": [{"replica", "score",
"num_tokens_by_medium"}, ...]}``, best first; all-zero scores mean "no replica holds anything of
it": the router's default policy decides. A gap in a replica's sequence numbers (lost events) makes
the scorer forget that replica until it announces again.

``--policy prefix`` ranks by vLLM's own GPU blocks instead (``prefix_index.py``, the baseline).
With ``--fallback-url`` (the fleet's vllm-router) it is also the routing front (``front.py``): it
proxies chat and completion requests to the best replica, or to the router, and serves
``/metrics``. ``orbitkv route ...`` runs the same.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch

from .front import PROXIED_PATHS, RoutingFront
from .local_tokenizer import LocalTokenizer
from .prefix_index import PrefixIndex
from .scorer import ChunkSetScorer

logger = logging.getLogger(__name__)
END_SEQ = -1  # vLLM's publisher sends it when it shuts down
POLICIES = {"chunk_set": ChunkSetScorer, "prefix": PrefixIndex}


class EventFeed:
    """One thread reading every replica's publisher into the scorer."""

    def __init__(self, scorer: Any, endpoints: dict[str, str]) -> None:
        self._scorer = scorer
        self._ctx = zmq.Context()
        self._sockets: dict[Any, str] = {}
        self._poller = zmq.Poller()
        for replica, endpoint in endpoints.items():
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)
            self._poller.register(sock, zmq.POLLIN)
            self._sockets[sock] = replica
        self._last_seq: dict[str, int] = {}
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.num_batches = 0
        self.num_gaps = 0
        # Per replica, for the router's /metrics: batches, gaps, and events by (type, medium).
        self.batches_by_replica: Counter[str] = Counter()
        self.gaps_by_replica: Counter[str] = Counter()
        self.events_by_kind: Counter[tuple[str, str, str]] = Counter()
        self._is_running = True
        self._thread = threading.Thread(target=self._run, name="orbitkv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._is_running:
            for sock, _ in self._poller.poll(200):
                try:
                    self._receive(self._sockets[sock], sock.recv_multipart())
                except Exception:
                    logger.exception("OrbitKV routing: a bad event message")

    def _receive(self, replica: str, frames: list[bytes]) -> None:
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq == END_SEQ:
            return
        last = self._last_seq.get(replica)
        if last is not None and seq != last + 1:
            self.num_gaps += 1
            self.gaps_by_replica[replica] += 1
            self._scorer.forget(replica)  # what it holds is no longer known
        self._last_seq[replica] = seq
        batch = self._decoder.decode(payload)
        self._scorer.apply_batch(replica, batch)
        for ev in batch.events:
            medium = getattr(ev, "medium", None) or "GPU"
            self.events_by_kind[(replica, type(ev).__name__, medium)] += 1
        self.num_batches += 1
        self.batches_by_replica[replica] += 1

    def close(self) -> None:
        self._is_running = False
        self._thread.join(timeout=2)
        for sock in self._sockets:
            sock.close(0)
        self._ctx.term()


def make_server(scorer: Any, replicas: list[str], host: str, port: int,
                front: RoutingFront | None = None) -> ThreadingHTTPServer:
    """``/rank`` and ``/health``; with a ``front``, also ``/metrics`` and the proxied paths."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path == "/metrics" and front is not None:
                data = front.metrics()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self._reply(200, {"status": "ok"} if self.path == "/health" else {"error": "not found"})

        def do_POST(self) -> None:
            if front is not None and self.path in PROXIED_PATHS:
                front.handle(self, self.path, self.rfile.read(int(self.headers.get("Content-Length", 0))))
                return
            if self.path != "/rank":
                self._reply(404, {"error": "not found"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                token_ids = [int(t) for t in body["token_ids"]]
                block_hashes = list(body.get("block_hashes") or ())
            except (ValueError, KeyError, TypeError) as exc:
                self._reply(400, {"error": f"expected {{'token_ids': [int, ...]}}: {exc}"})
                return
            ranking = scorer.score_tokens(replicas, token_ids, block_hashes)
            self._reply(200, {"ranking": [
                {"replica": s.replica, "score": s.score,
                 "num_tokens_by_medium": s.num_tokens_by_medium} for s in ranking
            ]})

        def _reply(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica", action="append", required=True,
                        help="NAME=ZMQ_ENDPOINT (NAME: how the router names the replica)")
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--policy", choices=POLICIES, default="chunk_set",
                        help="chunk_set: OrbitKV's tier events, chunks anywhere in the prompt; "
                        "prefix: vLLM's own GPU blocks, longest prefix (llm-d's and Dynamo's way)")
    parser.add_argument("--fallback-url",
                        help="the fleet's router: with it, this service also proxies "
                        f"{' and '.join(PROXIED_PATHS)} to the best replica (NAME must then be "
                        "the replica's URL), and to the router when no replica holds anything")
    parser.add_argument("--load-weight", type=float, default=1.0,
                        help="prompt tokens in flight to a replica count this much against it, "
                        "beside the tokens it would compute (0: rank by holdings alone)")
    parser.add_argument("--tokenizer",
                        help="the served model's directory (or hub name): the front tokenizes "
                        "text-only requests itself, checked against a replica's /tokenize first, "
                        "instead of asking a replica for every request")
    args = parser.parse_args(argv)
    if args.load_weight < 0:
        parser.error(f"--load-weight must be >= 0, got {args.load_weight}")
    endpoints = {}
    for spec in args.replica:
        name, sep, endpoint = spec.rpartition("=")
        if not sep or not name or not endpoint:
            parser.error(f"--replica takes NAME=ZMQ_ENDPOINT, got {spec!r}")
        endpoints[name] = endpoint
    scorer = POLICIES[args.policy](args.block_size)
    feed = EventFeed(scorer, endpoints)
    front = None
    if args.fallback_url:
        tokenizer = LocalTokenizer(args.tokenizer) if args.tokenizer else None
        front = RoutingFront(scorer, list(endpoints), args.fallback_url, args.policy, feed=feed,
                             load_weight=args.load_weight, tokenizer=tokenizer)
    server = make_server(scorer, list(endpoints), args.host, args.port, front)
    try:
        server.serve_forever()
    finally:
        feed.close()


if __name__ == "__main__":
    main()
