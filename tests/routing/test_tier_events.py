"""Tier events from real stores (memory, disk, Redis), decoded with vLLM's msgspec classes."""

from __future__ import annotations

import time

import pytest
from events_testlib import (
    BS,
    canonical_key,
    cid_of,
    conditioned_key,
    entry,
    vllm_block_hashes,
    wire,
)
from orbitkv.store.entry import encode
from orbitkv.store.tiered import TieredStore
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from orbitkv.routing.tier_events import TierEvents, prefix_blocks


def _as_int(h: bytes) -> int:
    # vLLM publishes the low 64 bits of its sha256 block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


def test_memory_and_disk_announce_stores_and_evictions(tmp_path):
    prompt = list(range(100, 116))  # chunks [0, 8) and [8, 16): two blocks each
    hashes = vllm_block_hashes(prompt)
    c0, c1, c2 = cid_of(prompt[:8]), cid_of(prompt[8:]), cid_of([7] * 8)
    k1, k0, k2 = conditioned_key(c1, [c0]), canonical_key(c0), canonical_key(c2)
    e1, e0, e2 = entry("conditioned", 8, [c0]), entry("canonical", 8), entry("canonical", 8, seed=2)
    unknown = canonical_key(cid_of([9] * 8))
    nbytes = max(len(encode(e)) for e in (e1, e0, e2))
    budget = int(nbytes * 3.5)  # a fourth entry evicts the oldest, in memory and on disk alike
    store = TieredStore(memory_nbytes=budget, disk_dir=str(tmp_path), disk_nbytes=budget)
    events = TierEvents(BS)
    try:
        events.attach(store)
        events.describe_chunk(c0, prompt[:8])
        events.describe_chunk(c1, prompt[8:])
        events.describe_chunk(c2, [7] * 8)
        events.describe_prefix(k1, prefix_blocks(c1, prompt, hashes, 8, 16, BS))
        store.put_many([(k1, e1), (k0, e0), (unknown, entry("canonical", 8, seed=9))])
        store.flush()
        first = wire(events.take()).events
        stored = [e for e in first if isinstance(e, BlockStored)]
        assert len(stored) == len(first)
        assert sorted(e.medium for e in stored) == ["CPU", "CPU", "DISK", "DISK"]
        cond = [e for e in stored if e.extra_keys[0][2] == "conditioned"]
        for e in cond:  # exactly the blocks vLLM hashed for these tokens
            assert e.block_hashes == [_as_int(hashes[2]), _as_int(hashes[3])]
            assert e.parent_block_hash == _as_int(hashes[1])
            assert e.token_ids == prompt[8:16] and e.block_size == BS
            assert e.extra_keys == [("orbitkv", c1, "conditioned", 8)] * 2
            assert e.locality == "LOCAL"
        canon = [e for e in stored if e.extra_keys[0][2] == "canonical"]
        assert len(cond) == len(canon) == 2
        for e in canon:  # position-free: its own tokens, hashes no prefix router computes
            assert e.token_ids == prompt[:8] and e.parent_block_hash is None
            assert not set(e.block_hashes) & {_as_int(h) for h in hashes}
        assert events.counters["unknown.memory"] == events.counters["unknown.disk"] == 1

        store.put(k2, e2)  # memory and disk both evict their oldest: k1
        store.flush()
        later = wire(events.take()).events
        removed = [e for e in later if isinstance(e, BlockRemoved)]
        assert sorted(e.medium for e in removed) == ["CPU", "DISK"]
        for e in removed:
            assert e.block_hashes == cond[0].block_hashes
        assert store.lookup([k1]) == [None]
        assert sorted(e.medium for e in later if isinstance(e, BlockStored)) == ["CPU", "DISK"]
    finally:
        events.detach(store)
        store.close()


@pytest.mark.redis
def test_redis_is_announced_once_by_the_replica_that_wrote_it(redis_server):
    tokens = list(range(40, 52))
    cid = cid_of(tokens)
    key = canonical_key(cid)
    a = TieredStore(memory_nbytes=1 << 20, redis_url=redis_server.url)
    b = TieredStore(memory_nbytes=1 << 20, redis_url=redis_server.url)
    ea, eb = TierEvents(BS), TierEvents(BS)
    try:
        for store, events in ((a, ea), (b, eb)):
            events.attach(store)
            events.describe_chunk(cid, tokens)
            events.take()
        a.put(key, entry("canonical", 12))
        a.flush()
        assert b.get([key])[0] is not None  # a Redis hit, promoted into b's memory
        b.flush()
        from_a, from_b = wire(ea.take()).events, wire(eb.take()).events
        assert sorted((e.medium, e.locality) for e in from_a) == [
            ("CPU", "LOCAL"), ("REDIS", "REMOTE")
        ]
        assert [(e.medium, e.locality) for e in from_b] == [("CPU", "LOCAL")]
        assert from_a[0].block_hashes == from_b[0].block_hashes  # one key: the same blocks

        b.delete([key])  # b never announced the Redis copy, but it is the one that removed it
        removed = wire(eb.take()).events
        assert sorted((e.medium, e.locality) for e in removed) == [
            ("CPU", "LOCAL"), ("REDIS", "REMOTE")
        ]
        assert all(isinstance(e, BlockRemoved) for e in removed)
        assert not ea.take()  # a's memory still holds it; a announces nothing more
    finally:
        ea.detach(a)
        eb.detach(b)
        a.close()
        b.close()


def test_queue_is_bounded_oldest_dropped(tmp_path):
    store = TieredStore(memory_nbytes=1 << 20)
    events = TierEvents(BS, max_queue=3)
    try:
        events.attach(store)
        cids = [cid_of([i] * 4) for i in range(5)]
        for i, cid in enumerate(cids):
            events.describe_chunk(cid, [i] * 4)
        store.put_many([(canonical_key(c), entry("canonical", 4, seed=i)) for i, c in
                        enumerate(cids)])
        got = events.take()
        assert [e.token_ids[0] for e in got] == [2, 3, 4]
        assert events.num_dropped == 2  # the first two stores
    finally:
        events.detach(store)
        store.close()


@pytest.mark.redis
def test_redis_expiry_is_announced_by_the_replica_that_stored_it(redis_server):
    from orbitkv.routing.redis_watch import start

    tokens = list(range(60, 68))
    cid = cid_of(tokens)
    a = TieredStore(redis_url=redis_server.url, redis_ttl_s=1.0, is_memory=False)
    b = TieredStore(redis_url=redis_server.url, redis_ttl_s=1.0, is_memory=False)
    ea, eb = TierEvents(BS), TierEvents(BS)
    watchers = []
    try:
        for store, events in ((a, ea), (b, eb)):
            events.attach(store)
            events.describe_chunk(cid, tokens)
            watchers.append(start(store, events))
            events.take()
        assert None not in watchers
        a.put(canonical_key(cid), entry("canonical", 8))
        a.flush()
        (stored,) = wire(ea.take()).events
        deadline = time.monotonic() + 10
        got: list = []
        while not got and time.monotonic() < deadline:
            time.sleep(0.2)
            got = ea.take()
        removed = wire(got).events
        assert [(type(e), e.medium, e.locality) for e in removed] == [
            (BlockRemoved, "REDIS", "REMOTE")
        ]
        assert removed[0].block_hashes == stored.block_hashes
        assert not eb.take()  # b heard the expiry too, but never announced the entry
    finally:
        for w in watchers:
            if w is not None:
                w.close()
        a.close()
        b.close()
