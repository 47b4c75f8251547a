"""Faults with real processes: Redis killed mid-workload, two processes sharing disk + Redis (entries,
and concurrent additions to one CID's survivor index)."""

from __future__ import annotations

import multiprocessing
import time

import pytest
from orbitkv.store.disk import DiskBackend
from orbitkv.store.keys import index_key
from orbitkv.store.redis_backend import RedisBackend
from orbitkv.store.tiered import TieredStore
from store_testing import (
    FP,
    canonical,
    canonical_key,
    cid_of,
    conditioned,
    conditioned_key,
    index_worker,
    same_tensors,
    shared_worker,
)

pytestmark = pytest.mark.redis

TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def pool():
    """Two spawned worker processes, shared by this module's tests (each spawn imports torch)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as workers, ctx.Manager() as manager:
        yield workers, manager


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


def test_two_processes_share_disk_and_redis_without_torn_reads(redis_server, tmp_path, pool):
    workers, _ = pool
    results = workers.starmap(shared_worker, [(str(tmp_path), redis_server.url, w, 40) for w in range(2)])
    assert all(r["num_corrupt"] == 0 and r["errors"] == 0 for r in results), results
    assert sum(r["num_reads"] for r in results) > 300


def test_two_processes_add_to_one_cid_at_once_and_both_survive(redis_server, tmp_path, pool):
    """Two nodes add different antecedents to one CID's index at the same moment, through one real
    redis-server (and one shared disk directory): no addition is lost in either tier."""
    workers, manager = pool
    num_adds = 25
    barrier = manager.Barrier(2)
    got = workers.starmap(index_worker, [(str(tmp_path), redis_server.url, w, num_adds, barrier) for w in (1, 2)])
    assert all(r["is_flushed"] and r["errors"] == 0 and r["dropped"] == 0 for r in got), got
    expected = {(cid_of([1000 * w + i]),) for w in (1, 2) for i in range(num_adds)}
    name = index_key(cid_of([0]))
    remote = RedisBackend(redis_server.url)
    try:
        assert set(remote.batch_index_get([name])[0]) == expected
    finally:
        remote.close()
    assert set(DiskBackend(tmp_path, 64 << 20).batch_index_get([name])[0]) == expected
    with TieredStore(memory_nbytes=1 << 20, redis_url=redis_server.url, max_antecedents_per_cid=256) as reader:
        assert set(reader.batch_antecedents([cid_of([0])])[0]) == expected


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
        # The survivor index (a sorted set per CID, added to by a script) works across slots.
        b, ante = cid_of([500]), [cid_of([501])]
        store.put(conditioned_key(b, ante), conditioned(ante))
        store.flush(10)
    with TieredStore(memory_nbytes=10_000, redis_url=redis_cluster.url) as other:
        assert other.batch_antecedents([b]) == [[tuple(ante)]]
        assert other.stats()["redis.errors"] == 0
