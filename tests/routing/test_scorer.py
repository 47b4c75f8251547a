"""The chunk-set scorer fed with tier events from real stores, over vLLM's wire format."""

from __future__ import annotations

import pytest
from events_testlib import BS, canonical_key, cid_of, entry, wire
from orbitkv.store.disk import DiskBackend
from orbitkv.store.tiered import TieredStore
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

from orbitkv.routing.scorer import TIER_WEIGHTS, ChunkSetScorer
from orbitkv.routing.tier_events import TierEvents

X = list(range(1000, 1012))  # 12 tokens: 3 blocks
Y = list(range(2000, 2020))  # 20 tokens: 5 blocks
Z = list(range(3000, 3008))  # 8 tokens: 2 blocks


def _replica(store: TieredStore) -> TierEvents:
    events = TierEvents(BS)
    events.attach(store)
    for tokens in (X, Y, Z):
        events.describe_chunk(cid_of(tokens), tokens)
    return events


def _put(store: TieredStore, *chunks: list[int]) -> None:
    store.put_many([(canonical_key(cid_of(t)), entry("canonical", len(t))) for t in chunks])
    store.flush()


def _scores(scorer, tokens) -> dict[str, float]:
    return {s.replica: s.score for s in scorer.score_tokens(["a", "b"], tokens)}


@pytest.mark.redis
def test_ranks_replicas_by_chunks_held_in_any_order_weighted_by_tier(tmp_path, redis_server):
    a = TieredStore(memory_nbytes=1 << 20, redis_url=redis_server.url)  # memory + shared Redis
    b = TieredStore(backends=[DiskBackend(str(tmp_path), 1 << 20)])  # a disk only
    ea, eb = _replica(a), _replica(b)
    scorer = ChunkSetScorer(BS)
    try:
        _put(a, X, Z)
        _put(b, X, Y)
        scorer.apply_batch("a", wire(ea.take()))
        scorer.apply_batch("b", wire(eb.take()))
        # Reordered, at offsets that are not block-aligned, around tokens nobody holds.
        request = [5, 6, 7] + Y + [8, 9] + X + Z + [1]
        assert scorer.find_chunks(request) == [
            (3, cid_of(Y)), (3 + 20 + 2, cid_of(X)), (3 + 20 + 2 + 12, cid_of(Z))
        ]
        w = TIER_WEIGHTS
        # a holds X and Z in memory; they reached Redis through a only, and count for b as well
        # (every replica reads Redis), where b has nothing cheaper.
        expect_a = (12 + 8) * w["CPU"]
        expect_b = 12 * w["DISK"] + 20 * w["DISK"] + 8 * w["REDIS"]
        assert _scores(scorer, request) == pytest.approx({"a": expect_a, "b": expect_b})
        assert scorer.score_tokens(["a", "b"], request)[0].replica == "b"

        b.delete([canonical_key(cid_of(Y))])  # b drops Y: its BlockRemoved reaches the scorer
        scorer.apply_batch("b", wire(eb.take()))
        expect_b = 12 * w["DISK"] + 8 * w["REDIS"]
        assert _scores(scorer, request) == pytest.approx({"a": expect_a, "b": expect_b})
        assert scorer.score_tokens(["a", "b"], request)[0].replica == "a"

        scorer.forget("a")  # a restarts (its sequence starts over): its memory is gone, Redis not
        redis_only = (12 + 8) * w["REDIS"]
        assert _scores(scorer, request) == pytest.approx({"a": redis_only, "b": expect_b})

        scorer.forget("b")  # b's events were lost: nothing is claimed for it any more
        assert _scores(scorer, request) == pytest.approx({"a": redis_only, "b": redis_only})
        assert _scores(scorer, [1, 2, 3, 4, 5, 6]) == {"a": 0.0, "b": 0.0}  # default policy decides
    finally:
        ea.detach(a)
        eb.detach(b)
        a.close()
        b.close()


def test_chunks_by_cid_and_vllm_prefix_blocks_counted_once():
    scorer = ChunkSetScorer(BS)
    store = TieredStore(memory_nbytes=1 << 20)
    events = _replica(store)
    try:
        _put(store, X)
        scorer.apply_batch("a", wire(events.take()))
        ranked = scorer.score_chunks(["a", "b"], [(cid_of(Y), 20), (cid_of(X), 12)])
        assert [(s.replica, s.num_tokens_by_medium) for s in ranked] == [
            ("a", {"CPU": 12}), ("b", {})
        ]
        # vLLM's own GPU blocks for the first 8 tokens of X: those count once, as GPU.
        gpu = BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=X[:8],
                          block_size=BS, lora_id=None, medium="GPU", lora_name=None)
        scorer.apply_batch("a", wire([gpu]))
        (score,) = scorer.score_tokens(["a"], X + Z, block_hashes=[11, 12, 13])
        assert score.num_tokens_by_medium == {"GPU": 8, "CPU": 4}
        scorer.apply("a", AllBlocksCleared())  # vLLM's reset_prefix_cache: OrbitKV's tiers stay
        (score,) = scorer.score_tokens(["a"], X + Z, block_hashes=[11, 12, 13])
        assert score.num_tokens_by_medium == {"CPU": 12}
        store.delete([canonical_key(cid_of(X))])  # held nowhere now: its tokens are not kept
        scorer.apply_batch("a", wire(events.take()))
        assert scorer.find_chunks(X) == []
    finally:
        events.detach(store)
        store.close()
