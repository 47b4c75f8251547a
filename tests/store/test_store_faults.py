"""Faults with real processes: Redis killed mid-workload, two processes sharing disk + Redis."""

from __future__ import annotations

import multiprocessing
import time

import pytest
from orbitkv.store.tiered import TieredStore
from store_testing import (
    FP,
    canonical,
    canonical_key,
    cid_of,
    conditioned,
    conditioned_key,
    same_tensors,
    shared_worker,
)

pytestmark = pytest.mark.redis

TIMEOUT_S = 0.5


def _remote_store(url: str, **kw) -> TieredStore:
    return TieredStore(memory_nbytes=20_000, redis_url=url, redis_socket_timeout_s=TIMEOUT_S,
                       redis_connect_timeout_s=TIMEOUT_S, redis_backoff_s=0.2, **kw)


def test_redis_killed_mid_workload_then_restarted(redis_server, tmp_path):
    store = _remote_store(redis_server.url, disk_dir=str(tmp_path), disk_nbytes=1 << 20,
                          is_disk_fsync=False)
    keys = [canonical_key(i) for i in range(12)]
    for i, key in enumerate(keys):
        store.put(key, canonical(seed=i))
    assert store.flush(10)
    worst_s = 0.0
    for round_ in range(30):
        if round_ == 5:
            redis_server.kill()
        start = time.monotonic()
        got = store.get(keys, expect_fingerprint=FP)
        store.lookup(keys)
        store.put(canonical_key(100 + round_), canonical(seed=100 + round_))
        store.batch_antecedents([k.cid for k in keys])
        worst_s = max(worst_s, time.monotonic() - start)
        # Memory + disk still answer everything they hold: a dead Redis costs misses, not errors.
        assert all(e is not None for e in got)
    assert worst_s < 4 * TIMEOUT_S + 0.5, worst_s
    assert store.flush(10)
    s = store.stats()
    assert s["redis.errors"] >= 1 and s["redis.dropped_writes"] >= 1

    redis_server.start()  # same port, empty
    key = canonical_key(999)
    deadline = time.monotonic() + 5
    while True:
        store.put(key, canonical(seed=999))
        store.flush(5)
        if store.tiers[-1].batch_exists([key.to_str()]) == [True]:
            break
        assert time.monotonic() < deadline, "store did not reconnect"
        time.sleep(0.1)
    store.close()


def test_redis_only_lower_tier_misses_within_timeout(redis_server):
    store = _remote_store(redis_server.url)
    keys = [canonical_key(i) for i in range(50)]  # far more than the 20 kB memory tier holds
    for i, key in enumerate(keys):
        store.put(key, canonical(seed=i))
    store.flush(10)
    assert all(e is not None for e in store.get(keys[:5]))  # from Redis, promoted
    redis_server.kill()
    for _ in range(10):
        start = time.monotonic()
        got = store.get(keys)
        assert time.monotonic() - start < 2 * TIMEOUT_S + 0.5
        assert any(e is None for e in got)  # evicted from memory and Redis is gone: a miss
    store.close()


def test_hung_redis_costs_one_timeout_then_breaker(redis_server):
    store = _remote_store(redis_server.url)
    keys = [canonical_key(i) for i in range(30)]
    for i, key in enumerate(keys):
        store.put(key, canonical(seed=i))
    store.flush(10)
    assert store.lookup([keys[0]]) == ["redis"]
    redis_server.pause()
    try:
        durations = []
        for _ in range(20):
            start = time.monotonic()
            store.get(keys)
            store.put(canonical_key(500), canonical(seed=500))
            durations.append(time.monotonic() - start)
        assert max(durations) < 2 * TIMEOUT_S + 0.5, durations
        # The breaker keeps most calls from waiting out a timeout at all.
        assert sorted(durations)[len(durations) // 2] < 0.2, durations
        assert store.stats()["redis.short_circuited"] > 0
    finally:
        redis_server.resume()
    deadline = time.monotonic() + 5
    while store.get([keys[0]]) == [None]:
        assert time.monotonic() < deadline, "no recovery after the server came back"
        time.sleep(0.1)
    store.close()


def test_survivor_index_shared_through_redis(redis_server, tmp_path):
    sys_, img, b = cid_of([1]), cid_of([2]), cid_of([3])
    with _remote_store(redis_server.url) as writer:
        writer.put(conditioned_key(b, [sys_, img]), conditioned([sys_, img]))
    with _remote_store(redis_server.url) as reader:  # another node: empty memory
        assert reader.batch_antecedents([b]) == [[(sys_, img)]]
        got = reader.get([conditioned_key(b, [sys_, img])])[0]
        assert same_tensors(got.tensors, conditioned([sys_, img]).tensors)
        assert reader.lookup([conditioned_key(b, [sys_, img])]) == ["memory"]


def test_two_processes_share_disk_and_redis_without_torn_reads(redis_server, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.starmap(shared_worker,
                               [(str(tmp_path), redis_server.url, w, 40) for w in range(2)])
    assert all(r["num_corrupt"] == 0 and r["errors"] == 0 for r in results), results
    assert sum(r["num_reads"] for r in results) > 300


def test_cluster_tier(redis_cluster):
    with TieredStore(memory_nbytes=10_000, redis_url=redis_cluster.url) as store:
        keys = [canonical_key(i) for i in range(20)]
        for i, key in enumerate(keys):
            store.put(key, canonical(seed=i))
        store.flush(10)
        store.memory.batch_delete([k.to_str() for k in keys])
        assert store.lookup(keys) == ["redis"] * 20
        got = store.get(keys)
        assert all(same_tensors(e.tensors, canonical(seed=i).tensors) for i, e in enumerate(got))
