"""The prefix baseline (what llm-d and Dynamo route by) against the chunk-set scorer, both fed the same
stream: vLLM's GPU blocks under vLLM's own block hashes, and a real store's tier events."""

from __future__ import annotations

from events_testlib import BS, canonical_key, cid_of, entry, vllm_block_hashes, wire
from orbitkv.store.tiered import TieredStore
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from orbitkv.routing.prefix_index import PrefixIndex, chain_key, request_keys
from orbitkv.routing.scorer import ChunkSetScorer
from orbitkv.routing.tier_events import TierEvents

A = list(range(100, 112))  # 3 blocks
B = list(range(200, 212))  # 3 blocks


def gpu_blocks(prompt: list[int], first: int, last: int) -> BlockStored:
    """vLLM's own event for blocks [first, last) of a prompt, with its hashes and parent."""
    hashes = vllm_block_hashes(prompt)
    return BlockStored(block_hashes=hashes[first:last],
                       parent_block_hash=hashes[first - 1] if first else None,
                       token_ids=prompt[first * BS : last * BS], block_size=BS, lora_id=None,
                       medium="GPU", lora_name=None)


def test_longest_held_prefix_matched_by_content():
    index = PrefixIndex(BS)
    prompt = A + B
    index.apply_batch("a", wire([gpu_blocks(prompt, 0, 2), gpu_blocks(prompt, 2, 4)]))
    index.apply_batch("b", wire([gpu_blocks(prompt, 0, 1)]))
    ranked = index.score_tokens(["a", "b"], prompt + [1, 2])
    assert [(s.replica, s.score) for s in ranked] == [("a", 16.0), ("b", 4.0)]
    # Another request sharing the first two blocks only.
    other = A[:8] + [9] * 8
    assert {s.replica: s.score for s in index.score_tokens(["a", "b"], other)} == {"a": 8.0, "b": 4.0}
    # The content keys are a chain: the same block after another prefix is another key.
    assert request_keys(A[4:8], BS) != [request_keys(A, BS)[1]]
    assert request_keys(A, BS)[1] == chain_key(chain_key(0, A[:4]), A[4:8])


def test_removed_cleared_orphans_and_forget():
    index = PrefixIndex(BS)
    prompt = A + B
    hashes = vllm_block_hashes(prompt)
    index.apply_batch("a", wire([gpu_blocks(prompt, 0, 4)]))
    index.apply_batch("a", wire([BlockRemoved(block_hashes=hashes[2:4], medium="GPU")]))
    assert index.score_tokens(["a"], prompt)[0].score == 8.0
    # A block whose parent the index never saw is skipped, as Dynamo's indexer does.
    index.apply_batch("b", wire([gpu_blocks(prompt, 2, 3)]))
    assert index.num_skipped_orphans == 1 and index.score_tokens(["b"], prompt)[0].score == 0.0
    index.apply("a", AllBlocksCleared())
    assert index.score_tokens(["a"], prompt)[0].score == 0.0
    index.apply_batch("a", wire([gpu_blocks(prompt, 0, 1)]))
    index.forget("a")
    assert index.score_tokens(["a"], prompt)[0].score == 0.0


def test_a_reordered_prompt_is_a_miss_for_prefix_routing_not_for_chunk_sets():
    """Replica a served A then B: vLLM's blocks and OrbitKV's entries of both chunks. The agent now
    sends B then A: the prefix index finds nothing anywhere (its default policy decides), the
    chunk-set scorer finds both chunks on a. OrbitKV's tier events in the same stream are not
    vLLM blocks: the prefix index ignores them."""
    store = TieredStore(memory_nbytes=1 << 20)
    events = TierEvents(BS)
    events.attach(store)
    try:
        for chunk in (A, B):
            events.describe_chunk(cid_of(chunk), chunk)
        store.put_many([(canonical_key(cid_of(c)), entry("canonical", len(c))) for c in (A, B)])
        store.flush()
        batch = wire([gpu_blocks(A + B, 0, 6), *events.take()])
        assert {e.medium for e in batch.events} == {"GPU", "CPU"}
        index, scorer = PrefixIndex(BS), ChunkSetScorer(BS)
        for policy in (index, scorer):
            policy.apply_batch("a", batch)
        assert index.score_tokens(["a", "b"], A + B)[0].score == 24.0
        reordered = B + A
        assert [s.score for s in index.score_tokens(["a", "b"], reordered)] == [0.0, 0.0]
        ranked = scorer.score_tokens(["a", "b"], reordered)
        assert [(s.replica, s.num_tokens_by_medium) for s in ranked] == [("a", {"CPU": 24}), ("b", {})]
        # Only the tier events (no vLLM blocks): the prefix index knows nothing.
        only_tiers = PrefixIndex(BS)
        only_tiers.apply_batch("a", wire([e for e in batch.events if e.medium != "GPU"]))
        assert only_tiers.score_tokens(["a"], A + B)[0].score == 0.0
    finally:
        events.detach(store)
        store.close()


def test_chunk_sets_count_the_held_prefix_by_content_without_vllm_hashes():
    """The routing front has a prompt's tokens, not vLLM's block hashes: the chunk-set scorer
    finds a replica's vLLM blocks by content, counts them as GPU once, and OrbitKV's chunks
    after them by their tier; vLLM's hashes, when a caller passes them, give the same figure."""
    store = TieredStore(memory_nbytes=1 << 20)
    events = TierEvents(BS)
    events.attach(store)
    try:
        events.describe_chunk(cid_of(B), B)
        store.put_many([(canonical_key(cid_of(B)), entry("canonical", len(B)))])
        store.flush()
        scorer = ChunkSetScorer(BS)
        scorer.apply_batch("a", wire([gpu_blocks(A + B, 0, 3)]))  # A's blocks in a's GPU memory
        scorer.apply_batch("b", wire(events.take()))  # B in b's memory tier
        prompt = A + B + [7, 7]
        by_content = scorer.score_tokens(["a", "b"], prompt)
        assert {s.replica: s.num_tokens_by_medium for s in by_content} == {"a": {"GPU": 12}, "b": {"CPU": 12}}
        assert [s.replica for s in by_content] == ["a", "b"]  # GPU weighs more than memory
        by_hash = scorer.score_tokens(["a", "b"], prompt, block_hashes=vllm_block_hashes(prompt))
        assert [(s.replica, s.score) for s in by_hash] == [(s.replica, s.score) for s in by_content]
        scorer.apply("a", AllBlocksCleared())
        assert scorer.score_tokens(["a"], prompt)[0].score == 0.0
        scorer.apply_batch("a", wire([gpu_blocks(A + B, 0, 3)]))
        scorer.forget("a")
        assert scorer.score_tokens(["a"], prompt)[0].score == 0.0
    finally:
        events.detach(store)
        store.close()
