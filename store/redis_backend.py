"""Redis / Redis Cluster tier: pipelined batches, TTL, bounded timeouts and a circuit breaker.

URLs:
- ``redis://[[user]:password@]host:port[/db]``, ``rediss://...`` (TLS), ``unix:///path.sock``:
  a single server through one connection pool.
- ``redis+cluster://[[user]:password@]host:port[,host:port...]``, ``rediss+cluster://...`` (TLS),
  ``redis-cluster://...`` (LMCache's spelling), or ``redis://``/``rediss://`` with the query flag
  ``?cluster=1``: Redis Cluster through ``redis.cluster.RedisCluster``, seeded from those nodes. The cluster pipeline groups commands by node, so a batch is one round trip per node that owns
  some of its keys (a plain ``MGET`` across slots is not allowed by Redis Cluster).

Each batch is one pipeline, so one round trip. Every socket op is bounded by ``socket_timeout_s``
and redis-py's own retries are off, so a dead server costs at most one timeout. Lookups
(``batch_exists``, ``batch_index_get``: what the scheduler plans with, on the engine's critical path)
use their own connection pool bounded by the shorter ``lookup_timeout_s``; a timeout there is
counted as ``lookup_timeouts``. After a failure the
breaker opens: calls return misses / drop writes at once for ``backoff_s`` (doubling up to
``max_backoff_s``), then one call probes the server again. redis-py reconnects its pool by itself,
so a restarted server is picked up on the first probe after the back-off.

The survivor index is a sorted set per CID (see ``antecedents.py``): ``batch_index_add`` pipelines
ZADD (score: the writer's clock), ZREMRANGEBYRANK (the cap) and PEXPIRE (the TTL) per addition, each
atomic on the server, so writers on several nodes never lose each other's additions. A key of
another type (an index written as a JSON blob by an older version) is replaced.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from . import antecedents, base
from .base import Backend

T = TypeVar("T")
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss", "redis-cluster": "redis"}
_SCHEMES = {"redis", "rediss", "unix"}
_TRUE = {"1", "true", "yes", "on"}



def _cluster_client(url: str, options: dict) -> RedisCluster:
    """RedisCluster from a (possibly multi-seed) ``redis://h1:p1,h2:p2`` url."""
    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    user, has_password, password = auth.partition(":")
    seeds = []
    for host_port in hosts.split(","):
        host, _, port = host_port.rpartition(":") if ":" in host_port else (host_port, "", "")
        seeds.append(ClusterNode(host.strip("[]"), int(port or 6379)))
    return RedisCluster(
        startup_nodes=seeds,
        username=unquote(user) or None,
        password=unquote(password) if has_password else None,
        ssl=parts.scheme == "rediss",
        **options,
    )


def parse_url(url: str) -> tuple[str, bool]:
    """Split a store URL into a redis-py URL and whether it names a cluster."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    query = parse_qsl(parts.query, keep_blank_values=True)
    flag = [v for k, v in query if k == "cluster"]
    is_cluster = scheme in _CLUSTER_SCHEMES or any(v.lower() in _TRUE for v in flag)
    scheme = _CLUSTER_SCHEMES.get(scheme, scheme)
    if scheme not in _SCHEMES:
        raise ValueError(f"unsupported remote url scheme {parts.scheme!r} in {url!r}")
    if is_cluster and scheme == "unix":
        raise ValueError("Redis Cluster needs a host:port url")
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    return urlunsplit((scheme, parts.netloc, parts.path, rest, parts.fragment)), is_cluster


class _Breaker:
    """Open after a failure for an exponentially growing back-off; one probe when it expires."""

    def __init__(self, backoff_s: float, max_backoff_s: float) -> None:
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._num_failures = 0
        self._closed_at = 0.0  # monotonic time when calls may go through again

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if now < self._closed_at:
                return False
            if self._num_failures:
                # Half-open: let this caller probe, hold the others back for one timeout's worth.
                self._closed_at = now + self.backoff_s
            return True

    def record(self, is_ok: bool) -> None:
        with self._lock:
            if is_ok:
                self._num_failures = 0
                self._closed_at = 0.0
                return
            self._num_failures += 1
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (self._num_failures - 1))
            self._closed_at = time.monotonic() + delay

    @property
    def is_up(self) -> bool:
        return self._num_failures == 0


class RedisBackend(Backend):
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        ttl_s: float | None = None,
        socket_timeout_s: float = 1.0,
        lookup_timeout_s: float | None = None,
        connect_timeout_s: float = 0.5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 5.0,
        max_connections: int = 32,
        key_prefix: str = "",
    ) -> None:
        super().__init__()
        self.url, self.is_cluster = parse_url(url)
        self.ttl_s = ttl_s if ttl_s and ttl_s > 0 else None
        self.key_prefix = key_prefix
        self._options = dict(
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            max_connections=max_connections,
        )
        lookup_timeout_s = socket_timeout_s if lookup_timeout_s is None else lookup_timeout_s
        self._lookup_options = dict(
            self._options,
            socket_timeout=min(socket_timeout_s, lookup_timeout_s),
            socket_connect_timeout=min(connect_timeout_s, lookup_timeout_s),
        )
        self._breaker = _Breaker(backoff_s, max_backoff_s)
        self._client_lock = threading.Lock()
        self._clients: dict[bool, redis.Redis | RedisCluster] = {}

    def _get_client(self, is_lookup: bool = False) -> redis.Redis | RedisCluster:
        # Built lazily: RedisCluster contacts the cluster in its constructor, which must not fail
        # the store's construction when Redis is down at start-up.
        with self._client_lock:
            client = self._clients.get(is_lookup)
            if client is None:
                options = self._lookup_options if is_lookup else self._options
                if self.is_cluster:
                    client = _cluster_client(self.url, options)
                else:
                    client = redis.Redis.from_url(self.url, **options)
                self._clients[is_lookup] = client
            return client

    def _call(
        self,
        what: str,
        fn: Callable[[redis.Redis | RedisCluster], T],
        default: T,
        *,
        is_lookup: bool = False,
    ) -> T:
        if not self._breaker.allow():
            self.counters.add("short_circuited")
            return default
        try:
            result = fn(self._get_client(is_lookup))
        except Exception as exc:  # any client failure is a miss / dropped write, never the caller's
            self._breaker.record(False)
            self.counters.add(base.ERRORS)
            self.counters.add(f"errors.{what}")
            if is_lookup and isinstance(exc, redis.exceptions.TimeoutError):
                self.counters.add("lookup_timeouts")
            return default
        self._breaker.record(True)
        return result

    def _pipelined(self, keys: Sequence[str], command: str, *args: object, **kwargs: object):
        def run(client: redis.Redis | RedisCluster) -> list:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                getattr(pipe, command)(self.key_prefix + key, *args, **kwargs)
            return pipe.execute(raise_on_error=False)

        return run

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        base.check_keys(keys)
        if not keys:
            return []
        results = self._call("get", self._pipelined(keys, "get"), None)
        if results is None:
            values: list[bytes | None] = [None] * len(keys)
        else:
            values = [r if isinstance(r, bytes) else None for r in results]
        self.count_reads(values)
        return values

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        base.check_keys(keys)
        if not keys:
            return []
        results = self._call("exists", self._pipelined(keys, "exists"), None, is_lookup=True)
        return [r == 1 for r in results] if results is not None else [False] * len(keys)

    def batch_touch(self, keys: Sequence[str]) -> list[bool]:
        """TOUCH (Redis' LRU clock, for ``allkeys-lru``) and, with a TTL, PEXPIRE, pipelined."""
        base.check_keys(keys)
        if not keys:
            return []
        px = int(self.ttl_s * 1000) if self.ttl_s else None

        def run(client: redis.Redis | RedisCluster) -> list:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.touch(self.key_prefix + key)
                if px:
                    pipe.pexpire(self.key_prefix + key, px)
            return pipe.execute(raise_on_error=False)

        results = self._call("touch", run, None)
        if results is None:
            return [False] * len(keys)
        return [r == 1 for r in results[:: 2 if px else 1]]

    def batch_put(self, items: Sequence[tuple[str, bytes]]) -> None:
        base.check_keys([k for k, _ in items])
        if not items:
            return
        px = int(self.ttl_s * 1000) if self.ttl_s else None

        def run(client: redis.Redis | RedisCluster) -> list:
            pipe = client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(self.key_prefix + key, value, px=px)
            return pipe.execute(raise_on_error=False)

        results = self._call("put", run, None)
        num_ok = 0 if results is None else sum(r is True for r in results)
        self.counters.add(base.WRITES, num_ok)
        self.counters.add(base.DROPPED_WRITES, len(items) - num_ok)
        if results is not None:
            self.counters.add(
                base.WRITTEN_NBYTES, sum(len(v) for (_, v), r in zip(items, results, strict=True) if r is True)
            )

    def batch_index_add(self, items: Sequence[tuple[str, antecedents.Antecedent]], max_len: int) -> None:
        """ZADD (score: now, in µs) then trim to the newest ``max_len``, per addition, pipelined.

        Each command is atomic on the server, so concurrent writers never lose an addition: however
        their commands interleave, every member is added and each trim keeps the newest ``max_len``.
        Plain commands rather than a script, because Redis Cluster pipelines do not run scripts.
        """
        base.check_keys([k for k, _ in items])
        if not items or max_len <= 0:
            return
        px = int(self.ttl_s * 1000) if self.ttl_s else None

        def add(pipe, key: str, antecedent: antecedents.Antecedent) -> None:
            name = self.key_prefix + key
            pipe.zadd(name, {antecedents.member(antecedent): time.time_ns() // 1000})
            pipe.zremrangebyrank(name, 0, -(max_len + 1))
            if px:
                pipe.pexpire(name, px)

        def run(client: redis.Redis | RedisCluster) -> list:
            pipe = client.pipeline(transaction=False)
            for key, antecedent in items:
                add(pipe, key, antecedent)
            results = pipe.execute(raise_on_error=False)
            step = 3 if px else 2
            zadds = results[0::step]
            # A value of another type (an index blob from an older version) is replaced, once.
            stale = [i for i, r in enumerate(zadds) if isinstance(r, redis.ResponseError) and "WRONGTYPE" in str(r)]
            if stale:
                pipe = client.pipeline(transaction=False)
                for i in stale:
                    pipe.delete(self.key_prefix + items[i][0])
                    add(pipe, *items[i])
                retried = pipe.execute(raise_on_error=False)[1 :: step + 1]
                for i, r in zip(stale, retried, strict=True):
                    zadds[i] = r
            return zadds

        results = self._call("index_add", run, None)
        num_ok = 0 if results is None else sum(isinstance(r, int) for r in results)
        self.counters.add("index_adds", num_ok)
        self.counters.add(base.DROPPED_WRITES, len(items) - num_ok)
        if results is not None and num_ok < len(items):
            self.counters.add(base.ERRORS, len(items) - num_ok)

    def batch_index_get(self, keys: Sequence[str]) -> list[list[antecedents.Antecedent] | None]:
        """Each index's members, oldest first (None: absent, unreachable, or not a sorted set)."""
        base.check_keys(keys)
        if not keys:
            return []
        results = self._call(
            "index_get", self._pipelined(keys, "zrange", 0, -1), None, is_lookup=True
        )
        if results is None:
            return [None] * len(keys)
        out: list[list[antecedents.Antecedent] | None] = []
        num_bad = 0
        for members in results:
            if not isinstance(members, list) or not members:
                out.append(None)  # absent, or a legacy value of another type (the next add replaces it)
                continue
            parsed = []
            for m in members:
                try:
                    parsed.append(antecedents.parse_member(m))
                except (ValueError, UnicodeDecodeError):
                    num_bad += 1
            out.append(parsed)
        if num_bad:
            self.counters.add("corrupt_index", num_bad)
        return out

    def batch_delete(self, keys: Sequence[str]) -> None:
        base.check_keys(keys)
        if keys:
            results = self._call("delete", self._pipelined(keys, "delete"), None)
            if results is not None:
                self.counters.add(base.DELETES, sum(r == 1 for r in results))

    def iter_keys(self) -> Iterator[str]:
        """All keys under the prefix; an unreachable server ends the iteration early, quietly."""
        keys = self._call(
            "scan",
            lambda c: list(c.scan_iter(match=self.key_prefix + "*", count=1000)),
            [],
        )
        skip = len(self.key_prefix)
        for key in keys:
            yield (key.decode() if isinstance(key, bytes) else key)[skip:]

    def stats(self) -> dict[str, float]:
        self.counters.set_gauge("is_up", float(self._breaker.is_up))
        return super().stats()

    def close(self) -> None:
        with self._client_lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            try:
                client.close()
            except Exception:
                self.counters.add(base.ERRORS)
