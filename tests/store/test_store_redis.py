"""Redis tier against a real redis-server: batching, TTL, auth, faults, cluster."""

from __future__ import annotations

import time

import pytest
import redis
from orbitkv.store.redis_backend import RedisBackend, parse_url

pytestmark = pytest.mark.redis


def test_parse_url():
    assert parse_url("redis://h:1/0") == ("redis://h:1/0", False)
    assert parse_url("rediss://:pw@h:1") == ("rediss://:pw@h:1", False)
    assert parse_url("redis+cluster://h:1") == ("redis://h:1", True)
    assert parse_url("rediss+cluster://u:p@h:1") == ("rediss://u:p@h:1", True)
    assert parse_url("redis://h:1?cluster=true&x=1") == ("redis://h:1?x=1", True)
    assert parse_url("redis-cluster://h:1,h2:2") == ("redis://h:1,h2:2", True)
    for bad in ("lm://h:1", "http://h", "unix+cluster:///s"):
        with pytest.raises(ValueError):
            parse_url(bad)


def test_batch_ops_are_one_round_trip(redis_server, monkeypatch):
    backend = RedisBackend(redis_server.url, key_prefix="t:")
    num_executes = []
    real_execute = redis.client.Pipeline.execute

    def counting_execute(self, *args, **kwargs):
        num_executes.append(len(self.command_stack))
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counting_execute)
    items = [(f"k{i}", bytes([i]) * i) for i in range(20)]
    backend.batch_put(items)
    client = redis.Redis.from_url(redis_server.url)
    before = client.info("stats")["total_connections_received"]
    calls_before = client.info("commandstats").get("cmdstat_get", {}).get("calls", 0)
    assert backend.batch_get([k for k, _ in items] + ["zz"]) == [v for _, v in items] + [None]
    assert client.info("commandstats")["cmdstat_get"]["calls"] - calls_before == 20
    # One pipeline (one round trip) per batch; a get learns its sizes first (EXISTS + STRLEN per
    # key, one pipeline) to bound its call by them, then GETs only the keys that exist.
    assert num_executes == [20, 42, 20]
    # Pooled connections: the first get opens only the lookup pool's, a second get opens none.
    assert client.info("stats")["total_connections_received"] == before + 1
    backend.batch_get(["k1", "zz"])
    assert client.info("stats")["total_connections_received"] == before + 1
    assert backend.batch_exists(["k1", "zz"]) == [True, False]
    assert sorted(backend.iter_keys()) == sorted(k for k, _ in items)
    assert client.exists("t:k1") == 1  # prefix applied
    backend.batch_delete(["k1", "k2"])
    assert backend.batch_exists(["k1", "k2", "k3"]) == [False, False, True]
    s = backend.stats()
    assert s["hits"] == 21 and s["misses"] == 2 and s["writes"] == 20 and s["errors"] == 0
    backend.close()


def test_ttl(redis_server):
    backend = RedisBackend(redis_server.url, ttl_s=30)
    backend.batch_put([("k", b"v")])
    ttl = redis.Redis.from_url(redis_server.url).pttl("k")
    assert 0 < ttl <= 30_000


def test_password_url(redis_password_server):
    good = RedisBackend(redis_password_server.url)
    good.batch_put([("k", b"v")])
    assert good.batch_get(["k"]) == [b"v"]
    wrong = RedisBackend(redis_password_server.url.replace("s3cret", "wrong"))
    assert wrong.batch_get(["k"]) == [None] and wrong.stats()["errors"] == 1


def test_dead_server_bounded_then_reconnects(redis_server):
    backend = RedisBackend(redis_server.url, socket_timeout_s=0.5, connect_timeout_s=0.5,
                           backoff_s=0.2, max_backoff_s=0.4)
    backend.batch_put([("k", b"v")])
    redis_server.kill()
    for _ in range(20):
        start = time.monotonic()
        assert backend.batch_get(["k"]) == [None]
        backend.batch_put([("k2", b"v")])
        assert backend.batch_exists(["k"]) == [False]
        assert list(backend.iter_keys()) == []
        assert time.monotonic() - start < 1.5
    assert backend.stats()["is_up"] == 0
    redis_server.start()
    deadline = time.monotonic() + 5
    while True:
        backend.batch_put([("k", b"back")])
        if backend.batch_get(["k"]) == [b"back"]:
            break
        assert time.monotonic() < deadline, "no reconnect after restart"
        time.sleep(0.1)
    assert backend.stats()["is_up"] == 1


def test_unreachable_at_start_no_exception():
    backend = RedisBackend("redis+cluster://127.0.0.1:1", socket_timeout_s=0.2, connect_timeout_s=0.2)
    start = time.monotonic()
    assert backend.batch_get(["a", "b"]) == [None, None]
    backend.batch_put([("a", b"1")])
    assert time.monotonic() - start < 2
    assert backend.stats()["dropped_writes"] >= 0


def test_cluster_batches_across_slots(redis_cluster):
    seeds = ",".join(f"127.0.0.1:{n.port}" for n in redis_cluster.nodes[1:])
    assert RedisBackend(f"redis-cluster://{seeds}").batch_get(["x"]) == [None]  # multi-seed url
    backend = RedisBackend(redis_cluster.url)
    items = [(f"okv1:canonical:{i:032x}", bytes(i)) for i in range(60)]
    backend.batch_put(items)
    assert backend.batch_get([k for k, _ in items]) == [v for _, v in items]
    assert all(backend.batch_exists([k for k, _ in items]))
    assert sorted(backend.iter_keys()) == sorted(k for k, _ in items)
    # The keys really are spread over the three masters.
    per_node = [redis.Redis(port=n.port).dbsize() for n in redis_cluster.nodes]
    assert backend.stats()["errors"] == 0
    assert all(n > 0 for n in per_node) and sum(per_node) == 60
    backend.batch_delete([k for k, _ in items[:10]])
    assert backend.batch_exists([items[0][0], items[10][0]]) == [False, True]
    backend.close()
