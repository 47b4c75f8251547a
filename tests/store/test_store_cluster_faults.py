"""Redis Cluster with a master down: only that master's slots are misses, the others keep serving.

A cluster of three masters that the test starts (and kills one of); the batches go through
``RedisBackend``'s per-master pipelines (``store/redis_cluster.py``).
"""

from __future__ import annotations

import time

import pytest
import redis
from orbitkv.store.redis_backend import RedisBackend
from redis_server import RedisClusterServers, has_redis

pytestmark = [pytest.mark.redis, pytest.mark.skipif(not has_redis(), reason="needs redis-server")]


def test_a_dead_master_costs_only_its_slots():
    # As deploy/docker-compose.yml runs its nodes: the others serve on while one is down.
    with RedisClusterServers(3, ("--cluster-require-full-coverage", "no")) as cluster:
        backend = RedisBackend(cluster.url, socket_timeout_s=0.5, connect_timeout_s=0.5, backoff_s=0.2)
        keys = [f"okv1:canonical:{i:032x}" for i in range(60)]
        backend.batch_put([(k, k.encode()) for k in keys])
        dead = cluster.nodes[1]
        on_dead = {k.decode() for k in redis.Redis(port=dead.port).keys("*")}
        assert 0 < len(on_dead) < len(keys)  # the keys really are spread
        dead.kill()
        # At once, later short-circuited, and once the cluster has marked the node failed (2 s).
        for pause_s in (0.1, 0.1, 2.5, 0.1):
            got = backend.batch_get(keys)
            assert [k for k, v in zip(keys, got, strict=True) if v is None] == [k for k in keys if k in on_dead]
            assert all(v == k.encode() for k, v in zip(keys, got, strict=True) if v is not None)
            assert backend.batch_exists(keys) == [k not in on_dead for k in keys]
            time.sleep(pause_s)
        assert backend.stats()["errors"] >= 1 and backend.stats()["is_up"] == 0
        backend.batch_put([(k, b"new") for k in keys])  # the live masters take their writes
        assert sum(v == b"new" for v in backend.batch_get(keys)) == len(keys) - len(on_dead)
        assert sorted(backend.iter_keys()) == sorted(k for k in keys if k not in on_dead)
        dead.start()  # back, empty, with its slots (nodes.conf)
        deadline = time.monotonic() + 10
        while True:
            backend.batch_put([(k, b"again") for k in keys])
            if backend.batch_get(keys) == [b"again"] * len(keys):
                break
            assert time.monotonic() < deadline, "the restarted master never took its slots back"
            time.sleep(0.2)
        assert backend.stats()["is_up"] == 1
        backend.close()
