"""The ranking service: vLLM's own ZMQ publishers in, ``POST /rank`` out."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import msgspec
import zmq
from events_testlib import BS, canonical_key, cid_of, entry
from orbitkv.store.tiered import TieredStore
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

from orbitkv.routing.scorer import ChunkSetScorer
from orbitkv.routing.service import EventFeed, make_server
from orbitkv.routing.tier_events import TierEvents

CHUNK = list(range(500, 516))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _rank(port: int, token_ids: list[int]) -> list[dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/rank",
                                 data=json.dumps({"token_ids": token_ids}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())["ranking"]


def test_service_ranks_from_vllm_publishers_and_forgets_after_a_gap():
    ports = {"a": _free_port(), "b": _free_port()}
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{ports['a']}")  # vLLM's own
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)  # b's stream by hand, to lose a message on purpose
    raw.bind(f"tcp://127.0.0.1:{ports['b']}")
    scorer = ChunkSetScorer(BS)
    feed = EventFeed(scorer, {n: f"tcp://127.0.0.1:{p}" for n, p in ports.items()})
    http_port = _free_port()
    server = make_server(scorer, ["a", "b"], "127.0.0.1", http_port)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    store = TieredStore(memory_nbytes=1 << 20)
    events = TierEvents(BS)
    try:
        events.attach(store)
        events.describe_chunk(cid_of(CHUNK), CHUNK)
        store.put(canonical_key(cid_of(CHUNK)), entry("canonical", len(CHUNK)))
        batch = KVEventBatch(ts=time.time(), events=events.take())
        time.sleep(0.5)  # ZMQ subscribers join late: let them connect first
        publisher.publish(batch)
        assert _wait(lambda: feed.num_batches >= 1)
        ranking = _rank(http_port, [1, 2, 3] + CHUNK + [4])
        assert [r["replica"] for r in ranking] == ["a", "b"]
        assert ranking[0]["num_tokens_by_medium"] == {"CPU": 16} and ranking[1]["score"] == 0

        raw.send_multipart((b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode(batch)))
        assert _wait(lambda: feed.num_batches >= 2)
        assert [r["score"] > 0 for r in _rank(http_port, CHUNK)] == [True, True]
        empty = KVEventBatch(ts=time.time(), events=[])
        raw.send_multipart((b"", (7).to_bytes(8, "big"), msgspec.msgpack.encode(empty)))
        assert _wait(lambda: feed.num_gaps == 1)  # b's messages 1 to 6 were lost
        ranking = _rank(http_port, CHUNK)
        assert [(r["replica"], r["score"] > 0) for r in ranking] == [("a", True), ("b", False)]
    finally:
        server.shutdown()
        feed.close()
        publisher.shutdown()
        raw.close(0)
        ctx.term()
        events.detach(store)
        store.close()
