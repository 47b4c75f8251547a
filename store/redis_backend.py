"""Redis / Redis Cluster tier: pipelined batches, TTL, bounded timeouts and a circuit breaker.

URLs:
- ``redis://[[user]:password@]host:port[/db]``, ``rediss://...`` (TLS), ``unix:///path.sock``:
  a single server through one connection pool.
- ``redis+cluster://[[user]:password@]host:port[,host:port...]``, ``rediss+cluster://...`` (TLS),
  ``redis-cluster://...`` (LMCache's spelling), or ``redis://``/``rediss://`` with the query flag
  ``?cluster=1``: Redis Cluster through ``redis.cluster.RedisCluster``, seeded from those nodes. A
  batch is one pipeline per master that owns some of its keys (``redis_cluster.py``), each master
  behind its own breaker: a master that is down makes only its own slots misses.

Each batch is one pipeline, so one round trip. Every call is bounded as a whole
(``redis_deadline.py``) by ``socket_timeout_s`` plus the bytes it moves at ``min_nbytes_per_s``: a
large chunk gets the time its size needs on a slow network, a small call about the base timeout.
A read learns its sizes first (``EXISTS`` + ``STRLEN``, pipelined: one more round trip), so it is
bounded the same way. redis-py's own retries are off, so a dead server costs at most one timeout. Lookups
(``batch_exists``, ``batch_index_get``: what the scheduler plans with, on the engine's critical path)
use their own connection pool bounded by the shorter ``lookup_timeout_s``; a timeout there is
counted as ``lookup_timeouts``. Reads and writes have separate circuit breakers, so failing writes
(a full or slow link for large values) never turn reads into misses. After a failure the breaker
opens: its calls return misses / drop writes at once for ``backoff_s`` (doubling up to
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

from orbitkv.config_values import redact_url

from . import antecedents, base, redis_deadline
from .base import Backend
from .redis_cluster import AddCommands, Breaker, NodeBatches

T = TypeVar("T")
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss", "redis-cluster": "redis"}
_SCHEMES = {"redis", "rediss", "unix"}
_TRUE = {"1", "true", "yes", "on"}



# TLS options a URL may carry (``rediss://...?ssl_ca_certs=/ca.crt``). redis-py reads them from a
# single server's URL itself; the cluster client is built from parts, so they are passed on here.
_TLS_QUERY = {"ssl_ca_certs": str, "ssl_certfile": str, "ssl_keyfile": str, "ssl_cert_reqs": str,
              "ssl_check_hostname": lambda v: v.lower() in _TRUE}


def _cluster_client(url: str, options: dict) -> RedisCluster:
    """RedisCluster from a (possibly multi-seed) ``redis://h1:p1,h2:p2`` url."""
    parts = urlsplit(url)
    tls = {k: _TLS_QUERY[k](v) for k, v in parse_qsl(parts.query) if k in _TLS_QUERY}
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
        **(tls if parts.scheme == "rediss" else {}),
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
        raise ValueError(f"unsupported remote url scheme {parts.scheme!r} in {redact_url(url)!r}")
    if is_cluster and scheme == "unix":
        raise ValueError("Redis Cluster needs a host:port url")
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    return urlunsplit((scheme, parts.netloc, parts.path, rest, parts.fragment)), is_cluster


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
        min_nbytes_per_s: float = float(25 << 20),
    ) -> None:
        super().__init__()
        self.socket_timeout_s = socket_timeout_s
        self.min_nbytes_per_s = min_nbytes_per_s
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
        self.lookup_timeout_s = self._lookup_options["socket_timeout"]
        # Writes fail for their own reasons (large values on a slow link): never make reads misses.
        self._breakers = {is_write: Breaker(backoff_s, max_backoff_s) for is_write in (False, True)}
        self._client_lock = threading.Lock()
        self._clients: dict[bool, redis.Redis | RedisCluster] = {}
        # A cluster runs one pipeline per master, each behind its own breaker (redis_cluster.py);
        # lookups have their own client (shorter timeouts), so their own node breakers too.
        # Reads and writes share a client but not their node breakers.
        self._nodes = self._lookup_nodes = self._write_nodes = None
        if self.is_cluster:
            self._nodes = NodeBatches(self._get_client, backoff_s, max_backoff_s, self.counters)
            self._lookup_nodes = NodeBatches(
                lambda: self._get_client(True), backoff_s, max_backoff_s, self.counters
            )
            self._write_nodes = NodeBatches(self._get_client, backoff_s, max_backoff_s, self.counters)

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
        is_write: bool = False,
    ) -> T:
        breaker = self._breakers[is_write]
        if not breaker.allow():
            self.counters.add("short_circuited")
            return default
        try:
            result = fn(self._get_client(is_lookup))
        except Exception as exc:  # any client failure is a miss / dropped write, never the caller's
            breaker.record(False)
            self.counters.add(base.ERRORS)
            self.counters.add(f"errors.{what}")
            if is_lookup and isinstance(exc, redis.exceptions.TimeoutError):
                self.counters.add("lookup_timeouts")
            self.counters.add(f"errors.{'write' if is_write else 'read'}")
            return default
        breaker.record(True)
        return result

    def _batch(
        self,
        what: str,
        keys: Sequence[str],
        add: AddCommands,
        step: int = 1,
        *,
        is_lookup: bool = False,
        is_write: bool = False,
        nbytes: Sequence[int] | None = None,
    ) -> list[list | None]:
        """Each key's ``step`` replies (None: its server or node failed), ``add`` queueing a
        key's commands. One pipeline; on a cluster one per master, so a dead master costs only
        its own keys. ``is_lookup``: on the lookup client (``lookup_timeout_s``); ``is_write``:
        behind the write breaker; ``nbytes``: each key's bytes on the wire, which extend the
        call's bound (``redis_deadline.call_timeout_s``)."""
        names = [self.key_prefix + k for k in keys]
        sizes = dict(zip(names, nbytes, strict=True)) if nbytes is not None else {}
        base_s = self.lookup_timeout_s if is_lookup else self.socket_timeout_s

        def timeout_of(group: Sequence[str]) -> float:
            total = sum(sizes.get(n, 0) for n in group)
            return redis_deadline.call_timeout_s(base_s, total, self.min_nbytes_per_s)

        nodes = self._lookup_nodes if is_lookup else self._write_nodes if is_write else self._nodes
        if nodes is not None:
            return nodes.run(what, names, add, step, timeout_of)

        def fill(pipe) -> None:
            for name in names:
                add(pipe, name)

        flat = self._call(
            what, lambda client: redis_deadline.execute(client, fill, timeout_of(names)), None,
            is_lookup=is_lookup, is_write=is_write,
        )
        if flat is None:
            return [None] * len(keys)
        return [flat[i * step : (i + 1) * step] for i in range(len(keys))]

    @staticmethod
    def _one(command: str, *args: object, **kwargs: object) -> AddCommands:
        return lambda pipe, name: getattr(pipe, command)(name, *args, **kwargs)

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """EXISTS and STRLEN first (one pipeline on the lookup client), so the GETs' bound
        covers their bytes; a key that is absent costs no GET."""
        base.check_keys(keys)
        if not keys:
            return []

        def sizes(pipe, name: str) -> None:
            pipe.exists(name)
            pipe.strlen(name)

        lengths = [
            r[1] if r is not None and r[0] == 1 and isinstance(r[1], int) else None
            for r in self._batch("strlen", keys, sizes, 2, is_lookup=True)
        ]
        present = [i for i, n in enumerate(lengths) if n is not None]
        values: list[bytes | None] = [None] * len(keys)
        if present:
            replies = self._batch("get", [keys[i] for i in present], self._one("get"),
                                  nbytes=[lengths[i] for i in present])
            for i, r in zip(present, replies, strict=True):
                values[i] = r[0] if r is not None and isinstance(r[0], bytes) else None
        self.count_reads(values)
        return values

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        base.check_keys(keys)
        if not keys:
            return []
        replies = self._batch("exists", keys, self._one("exists"), is_lookup=True)
        return [r is not None and r[0] == 1 for r in replies]

    def batch_touch(self, keys: Sequence[str]) -> list[bool]:
        """TOUCH (Redis' LRU clock, for ``allkeys-lru``) and, with a TTL, PEXPIRE, pipelined."""
        base.check_keys(keys)
        if not keys:
            return []
        px = int(self.ttl_s * 1000) if self.ttl_s else None

        def add(pipe, name: str) -> None:
            pipe.touch(name)
            if px:
                pipe.pexpire(name, px)

        replies = self._batch("touch", keys, add, 2 if px else 1, is_write=True)
        return [r is not None and r[0] == 1 for r in replies]

    def batch_put(self, items: Sequence[tuple[str, bytes]]) -> None:
        base.check_keys([k for k, _ in items])
        if not items:
            return
        px = int(self.ttl_s * 1000) if self.ttl_s else None
        values = {self.key_prefix + k: v for k, v in items}
        replies = self._batch("put", [k for k, _ in items],
                              lambda pipe, name: pipe.set(name, values[name], px=px),
                              is_write=True, nbytes=[memoryview(v).nbytes for _, v in items])
        is_ok = [r is not None and r[0] is True for r in replies]
        num_ok = sum(is_ok)
        # Only the replica whose write landed announces it: the shared tier is announced once.
        self.announce(base.STORED, [k for (k, _), ok in zip(items, is_ok, strict=True) if ok])
        self.counters.add(base.WRITES, num_ok)
        self.counters.add(base.DROPPED_WRITES, len(items) - num_ok)
        self.counters.add(base.WRITTEN_NBYTES, sum(len(v) for (_, v), ok in zip(items, is_ok, strict=True) if ok))

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
        step = 3 if px else 2
        members = {}
        for key, antecedent in items:
            members.setdefault(self.key_prefix + key, []).append(antecedents.member(antecedent))

        def add(pipe, name: str, member: str, *, is_replace: bool = False) -> None:
            if is_replace:
                pipe.delete(name)
            pipe.zadd(name, {member: time.time_ns() // 1000})
            pipe.zremrangebyrank(name, 0, -(max_len + 1))
            if px:
                pipe.pexpire(name, px)

        # A key may be added to twice in one batch: one command group per item, in order.
        pending = {name: iter(ms) for name, ms in members.items()}
        replies = self._batch("index_add", [k for k, _ in items],
                              lambda pipe, name: add(pipe, name, next(pending[name])), step,
                              is_write=True)
        zadds = [None if r is None else r[0] for r in replies]
        # A value of another type (an index blob from an older version) is replaced, once.
        stale = [i for i, r in enumerate(zadds) if isinstance(r, redis.ResponseError) and "WRONGTYPE" in str(r)]
        if stale:
            redo = {self.key_prefix + items[i][0]: iter([antecedents.member(items[i][1])]) for i in stale}
            retried = self._batch("index_add", [items[i][0] for i in stale],
                                  lambda pipe, name: add(pipe, name, next(redo[name]), is_replace=True),
                                  step + 1, is_write=True)
            for i, r in zip(stale, retried, strict=True):
                zadds[i] = None if r is None else r[1]
        num_ok = sum(isinstance(r, int) for r in zadds)
        self.counters.add("index_adds", num_ok)
        self.counters.add(base.DROPPED_WRITES, len(items) - num_ok)
        if num_ok < len(items) and any(r is not None for r in zadds):
            self.counters.add(base.ERRORS, sum(r is not None and not isinstance(r, int) for r in zadds))

    def batch_index_get(self, keys: Sequence[str]) -> list[list[antecedents.Antecedent] | None]:
        """Each index's members, oldest first (None: absent, unreachable, or not a sorted set)."""
        base.check_keys(keys)
        if not keys:
            return []
        out: list[list[antecedents.Antecedent] | None] = []
        num_bad = 0
        for reply in self._batch("index_get", keys, self._one("zrange", 0, -1), is_lookup=True):
            members = None if reply is None else reply[0]
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
            replies = self._batch("delete", keys, self._one("delete"), is_write=True)
            is_gone = [r is not None and r[0] == 1 for r in replies]
            self.counters.add(base.DELETES, sum(is_gone))
            self.announce(base.REMOVED, [k for k, gone in zip(keys, is_gone, strict=True) if gone])

    def iter_keys(self) -> Iterator[str]:
        """All keys under the prefix; an unreachable server (or node) ends its part quietly."""
        match = self.key_prefix + "*"
        if self._nodes is not None:
            keys = list(self._nodes.scan(match))
        else:
            keys = self._call("scan", lambda c: list(c.scan_iter(match=match, count=1000)), [])
        skip = len(self.key_prefix)
        for key in keys:
            yield (key.decode() if isinstance(key, bytes) else key)[skip:]

    def stats(self) -> dict[str, float]:
        if self._nodes is None:
            is_read_up = self._breakers[False].is_up
            is_write_up = self._breakers[True].is_up
        else:
            is_read_up = self._nodes.is_up and self._lookup_nodes.is_up
            is_write_up = self._write_nodes.is_up
        self.counters.set_gauge("is_up", float(is_read_up and is_write_up))
        self.counters.set_gauge("is_read_up", float(is_read_up))
        self.counters.set_gauge("is_write_up", float(is_write_up))
        return super().stats()

    def close(self) -> None:
        with self._client_lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            try:
                client.close()
            except Exception:
                self.counters.add(base.ERRORS)
