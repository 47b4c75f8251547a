"""The survivor index under concurrent writers: atomic additions in memory, on disk and in Redis."""

from __future__ import annotations

import threading

import pytest
from orbitkv.store.disk import DiskBackend
from orbitkv.store.keys import index_key
from orbitkv.store.memory import MemoryBackend
from orbitkv.store.redis_backend import RedisBackend
from orbitkv.store.tiered import TieredStore
from store_testing import cid_of, conditioned, conditioned_key


def _ante(i: int) -> tuple[str, ...]:
    return (cid_of([i]), cid_of([i + 1]))


@pytest.mark.redis
def test_redis_index_is_a_capped_ordered_set_with_ttl(redis_server):
    import redis

    name = index_key(cid_of([0]))
    client = redis.Redis.from_url(redis_server.url)
    client.set(name, b'[["legacy"]]')  # an index blob from an older version is replaced
    remote = RedisBackend(redis_server.url, ttl_s=100.0)
    try:
        for i in range(5):
            remote.batch_index_add([(name, _ante(i))], 3)
        remote.batch_index_add([(name, _ante(2))], 3)  # re-adding makes it the newest
        assert remote.batch_index_get([name, index_key(cid_of([9]))]) == [[_ante(3), _ante(4), _ante(2)], None]
        assert client.type(name) == b"zset" and 0 < client.pttl(name) <= 100_000
        assert remote.stats()["index_adds"] == 6
    finally:
        remote.close()
        client.close()


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_local_index_adds_from_threads_all_survive(tmp_path, kind):
    backend = MemoryBackend(1 << 20) if kind == "memory" else DiskBackend(tmp_path, 1 << 20, is_fsync=False)
    name = index_key(cid_of([0]))

    def work(t: int) -> None:
        for i in range(20):
            backend.batch_index_add([(name, _ante(100 * t + i))], 500)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(backend.batch_index_get([name])[0]) == {_ante(100 * t + i) for t in range(4) for i in range(20)}


def test_disk_index_shared_by_two_backends_on_one_directory(tmp_path):
    """Two DiskBackends on one directory (as two processes would be) merge rather than overwrite."""
    first, second = DiskBackend(tmp_path, 1 << 20), DiskBackend(tmp_path, 1 << 20)
    name = index_key(cid_of([0]))
    first.batch_index_add([(name, _ante(1))], 8)
    second.batch_index_add([(name, _ante(2))], 8)
    assert first.batch_index_get([name]) == [[_ante(1), _ante(2)]]
    first.batch_put([(name, b"not json")])
    assert second.batch_index_get([name]) == [None] and second.stats()["corrupt_index"] == 1
    assert second.batch_exists([name]) == [False]


def test_store_index_with_all_local_tiers(tmp_path):
    b = cid_of([0])
    with TieredStore(memory_nbytes=1 << 20, disk_dir=str(tmp_path), disk_nbytes=1 << 20) as store:
        for i in range(3):
            store.put(conditioned_key(b, list(_ante(i))), conditioned(list(_ante(i))))
        assert store.flush()
        assert store.batch_antecedents([b]) == [[_ante(0), _ante(1), _ante(2)]]
        # Two writer threads may land the disk additions in either order.
        assert sorted(store.tiers[1].batch_index_get([index_key(b)])[0]) == sorted([_ante(0), _ante(1), _ante(2)])
