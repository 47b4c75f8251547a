"""The connector's events from the halves harness (a real store, real saves), decoded with vLLM's
classes and indexed by NVIDIA Dynamo's KV indexer (``ai-dynamo-runtime``'s ``RadixTree``)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "connector"))

from events_testlib import dynamo_event, vllm_block_hashes, wire  # noqa: E402
from halves_testlib import BS, build_halves, compute, release  # noqa: E402
from halves_testlib import request as _request  # noqa: E402
from orbitkv.connector.scheduler.kv_events import ConnectorEvents  # noqa: E402
from orbitkv.store.keys import conditioned_key  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402

from orbitkv.routing.scorer import ChunkSetScorer  # noqa: E402

PROMPT = list(range(300, 312))  # three 4-token chunks, one block each


def _as_int(h: bytes) -> int:
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


@pytest.fixture
def replica():
    built = build_halves()
    events = ConnectorEvents(built[3].store, BS, max_queue=1024)
    yield built, events
    events.close()
    release(built)


def _serve(built, events, req_id, tokens, blocks, seed=1):
    """What the connector does for one request: describe it before planning, compute, save."""
    req = _request(req_id, tokens)
    req.block_hashes = vllm_block_hashes(tokens)
    events.describe(req, built[0].admissions.chunks(req)[1])
    compute(built, req_id, tokens, blocks, seed=seed)
    return req


def test_saved_chunks_are_announced_with_vllm_block_hashes(replica):
    built, events = replica
    _serve(built, events, "r1", PROMPT, [1, 2, 3])
    batch = wire(events.take())
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    cond = [e for e in stored if e.extra_keys[0][2] == "conditioned"]
    hashes = [_as_int(h) for h in vllm_block_hashes(PROMPT)]
    assert [e.block_hashes for e in cond] == [[h] for h in hashes]
    assert [e.parent_block_hash for e in cond] == [None, hashes[0], hashes[1]]
    assert [e.token_ids for e in cond] == [PROMPT[0:4], PROMPT[4:8], PROMPT[8:12]]
    assert {e.medium for e in stored} == {"CPU"}
    assert [e.extra_keys[0][2] for e in stored].count("canonical") == 1  # the first chunk's


def test_dynamo_indexer_finds_an_orbitkv_replicas_chunks(replica):
    radix = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is not installed")

    built, events = replica
    req = _serve(built, events, "r1", PROMPT, [1, 2, 3])
    batch = wire(events.take())
    tree = radix.RadixTree()  # one tree per medium: this one indexes OrbitKV's memory tier
    worker = 7
    for i, event in enumerate(batch.events):
        payload = dynamo_event(i, event, BS)
        if payload is not None and getattr(event, "medium", "CPU") == "CPU":
            tree.apply_event(worker, payload)  # raises on an event Dynamo cannot place
    # A request with the same prompt and a new question: Dynamo finds all three blocks here.
    later = PROMPT + [999, 998, 997, 996]
    assert tree.find_matches(radix.compute_block_hash_for_seq(later, BS)).scores == {
        (worker, 0): 3
    }
    # Dynamo matches prefixes only: the same chunks reordered are a miss to it; the chunk-set
    # scorer, fed the same batch, finds all three (by their tokens, at any offset).
    reordered = PROMPT[8:12] + PROMPT[0:4] + PROMPT[4:8]
    assert tree.find_matches(radix.compute_block_hash_for_seq(reordered, BS)).scores == {}
    scorer = ChunkSetScorer(BS)
    scorer.apply_batch("r", batch)
    (score,) = scorer.score_tokens(["r"], reordered)
    assert score.num_tokens_by_medium == {"CPU": 12}

    # An eviction reaches Dynamo too: the last chunk's entry leaves the memory tier.
    last = built[0].admissions.chunks(req)[1][2]
    built[3].store.memory.batch_delete(
        [conditioned_key(last.cid, last.antecedent_hash)]
    )
    removed = wire(events.take()).events
    assert [type(e) for e in removed] == [BlockRemoved]
    tree.apply_event(worker, dynamo_event(100, removed[0], BS))
    assert tree.find_matches(radix.compute_block_hash_for_seq(later, BS)).scores == {
        (worker, 0): 2
    }
