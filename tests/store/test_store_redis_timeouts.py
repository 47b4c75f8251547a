"""Redis calls are bounded as a whole by remote_timeout_s plus their bytes at remote_min_nbytes_per_s,
and reads and writes have their own breakers: a real redis-server behind a slowed loopback link."""

from __future__ import annotations

import time

import pytest
import redis
from orbitkv.store.redis_backend import RedisBackend
from redis_server import has_redis
from slow_proxy import SlowProxy

pytestmark = pytest.mark.skipif(not has_redis(), reason="redis-server not installed")

MIB = 1 << 20


def _slow_backend(proxy: SlowProxy, **kw) -> RedisBackend:
    return RedisBackend(f"redis://127.0.0.1:{proxy.port}", backoff_s=30.0, **kw)


def test_a_large_write_gets_the_time_its_bytes_need(redis_server):
    value = b"x" * (8 * MIB)
    with SlowProxy(redis_server.port, nbytes_per_s=40 * MIB) as proxy:  # 8 MiB: about 0.2 s
        backend = _slow_backend(proxy, socket_timeout_s=0.1, min_nbytes_per_s=10 * MIB)
        started = time.monotonic()
        backend.batch_put([("big", value)])
        elapsed_s = time.monotonic() - started
        stats = backend.stats()
        assert stats["writes"] == 1 and stats["dropped_writes"] == 0, (elapsed_s, stats)
        assert elapsed_s > 0.1  # it did take longer than the base timeout
        assert backend.batch_get(["big"]) == [value]
        backend.close()


def test_a_read_is_bounded_as_a_whole_by_its_bytes(redis_server):
    redis.Redis.from_url(redis_server.url).set("big", b"y" * (8 * MIB))
    with SlowProxy(redis_server.port, nbytes_per_s=4 * MIB) as proxy:  # 8 MiB would take 2 s
        # Bound: 0.2 s + 8 MiB at 64 MiB/s = 0.325 s; every recv on its own comes well within it.
        backend = _slow_backend(proxy, socket_timeout_s=0.2, min_nbytes_per_s=64 * MIB)
        started = time.monotonic()
        assert backend.batch_get(["big"]) == [None]
        elapsed_s = time.monotonic() - started
        assert elapsed_s < 0.325 + 0.4, elapsed_s
        assert backend.stats()["errors"] == 1
        backend.close()


def test_failed_writes_leave_reads_up(redis_server):
    redis.Redis.from_url(redis_server.url).set("small", b"s" * 100)
    with SlowProxy(redis_server.port, nbytes_per_s=4 * MIB) as proxy:
        # A write of 8 MiB may take 0.1 s + 8 ms: it fails on this 4 MiB/s link.
        backend = _slow_backend(proxy, socket_timeout_s=0.1, min_nbytes_per_s=1024 * MIB)
        backend.batch_put([("big", b"x" * (8 * MIB))])
        stats = backend.stats()
        assert stats["dropped_writes"] == 1 and stats["is_write_up"] == 0
        # The write breaker is open (30 s back-off); reads still go to Redis and hit.
        assert backend.batch_get(["small"]) == [b"s" * 100]
        assert backend.batch_exists(["small"]) == [True]
        backend.batch_put([("other", b"o")])  # short-circuited by the write breaker
        assert backend.stats()["short_circuited"] == 1
        assert backend.stats()["is_read_up"] == 1
        backend.close()
