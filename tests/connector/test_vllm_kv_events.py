"""A real vLLM engine publishes OrbitKV's tier events through its own ZMQ publisher
(``--kv-events-config``), next to its GPU events, with the same block hashes for the same blocks."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq
from connector_vllm_testlib import CHUNK, flush, segment, tokens
from connector_vllm_testlib import engine as start_engine
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from orbitkv.routing.scorer import ChunkSetScorer

pytestmark = [pytest.mark.vllm]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_publishes_orbitkv_blocks_with_vllms_hashes(tmp_path):
    from vllm.config import KVEventsConfig

    from orbitkv.models.make_model import make_model

    model_dir = make_model(tmp_path / "qwen2", "qwen2")
    port = _free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}"
    )
    prompt = segment(1) + segment(2) + segment(3) + segment(4, 8)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    got: list = []
    try:
        with start_engine(model_dir, extra_config={"orbitkv_kv_events": True},
                          kv_events_config=events_config) as eng:
            eng.run(tokens(prompt), max_tokens=2)
            flush(eng)
            eng.run(tokens(segment(9, 8)), max_tokens=1)  # one more step takes the later events
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if sub.poll(500):
                    _, _, payload = sub.recv_multipart()
                    got.extend(decoder.decode(payload).events)
                elif any(isinstance(e, BlockStored) and e.medium == "CPU" for e in got):
                    break
    finally:
        sub.close(0)
        ctx.term()
    stored = [e for e in got if isinstance(e, BlockStored)]
    gpu = {  # vLLM's own blocks: hash -> that block's tokens
        h: e.token_ids[j * e.block_size : (j + 1) * e.block_size]
        for e in stored if e.medium in (None, "GPU") for j, h in enumerate(e.block_hashes)
    }
    orbit = [e for e in stored if e.medium == "CPU" and e.extra_keys[0][0] == "orbitkv"]
    cond = [e for e in orbit if e.extra_keys[0][2] == "conditioned"]
    assert len(cond) == 3, [e.extra_keys[0] for e in orbit]  # the three whole 32-token chunks
    for i, e in enumerate(cond):  # the very blocks vLLM announced for its own GPU cache
        assert e.token_ids == prompt[i * CHUNK : (i + 1) * CHUNK]
        assert len(e.block_hashes) == 1 and gpu.get(e.block_hashes[0]) == e.token_ids
    # The chunk-set scorer, fed this very stream, finds the three chunks in any order.
    scorer = ChunkSetScorer(CHUNK)
    for event in got:
        scorer.apply("replica", event)
    reordered = segment(3) + segment(1) + [5, 6, 7] + segment(2)
    (score,) = scorer.score_tokens(["replica"], reordered)
    assert score.num_tokens_by_medium == {"CPU": 3 * CHUNK}
