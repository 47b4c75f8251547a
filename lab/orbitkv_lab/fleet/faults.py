"""Fleet faults on a Redis Cluster: a node killed, a replica restarted mid-trace, memory full.

Runs on a ``LocalFleet`` of the compose file's ``redis-cluster`` + ``cpu`` profiles. Every measured
turn is repeated on the replica that served it with a fresh ``cache_salt`` (a full prefill) and the
greedy outputs compared. Phases, after two warm turns through the router:

1. **node down**: one cluster node is SIGKILLed; each session's next turn goes to the *other*
   replica, so its history can only come from Redis: the dead node's slots are misses (the
   replicas count store errors), every request completes with the reference output. The node is
   started again (empty; it rejoins from its nodes.conf);
2. **replica restart**: the replica holding most sessions is stopped; its sessions' next turn goes
   through the router, which sends them elsewhere; it is started again, and their next turn returns
   to it through the router: its prefix cache and memory tier are empty, so what it reuses comes
   from Redis;
3. **memory full**: every node's ``maxmemory`` is lowered (``CONFIG SET``) to what it holds plus
   a few MiB, far below a burst of new sessions' KV: Redis evicts (allkeys-lru), the replicas count
   no store error, requests complete.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from orbitkv.serving.http_client import scrape_metrics

from .runner import LocalFleet
from .sessions import Reply, Session, chat_body, make_sessions, send

STORE_ERRORS = "vllm:orbitkv_errors_total"
NODES = ("redis-node-0", "redis-node-1", "redis-node-2")


def node_clients(fleet: LocalFleet, password: str) -> list[Any]:
    import redis

    return [redis.Redis(host="127.0.0.1", port=fleet.port(n, 6379), password=password,
                        socket_timeout=2) for n in NODES]


def cluster_stat(clients: Sequence[Any], field: str) -> int:
    total = 0
    for c in clients:
        try:
            total += int(c.info("stats").get(field, 0))
        except Exception:  # a killed node has no stats; it holds nothing either
            continue
    return total


def wait_cluster_quiet(clients: Sequence[Any], quiet_s: float = 0.5, timeout_s: float = 30.0) -> int:
    """Until the cluster's key count stops changing (the replicas' write-behind drained)."""
    last, since = -1, time.monotonic()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = 0
        for c in clients:
            try:
                n += int(c.dbsize())
            except Exception:
                continue
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.1)
    return last


def store_errors(replicas: Sequence[str]) -> float:
    total = 0.0
    for url in replicas:
        try:
            m = scrape_metrics(url)
        except OSError:
            continue
        total += sum(v for k, v in m.items() if k.startswith(STORE_ERRORS))
    return total


class Checked:
    """Sends turns and checks each against a full prefill on the replica that served it."""

    def __init__(self, router: str, replicas: Sequence[str], max_tokens: int) -> None:
        self.router, self.replicas, self.max_tokens = router, list(replicas), max_tokens
        self.replies: list[dict[str, Any]] = []
        self.num_failed = 0
        self.num_mismatches = 0

    def turn(self, phase: str, s: Session, turn: int, *, to: int | None = None,
             check: bool = True) -> Reply:
        """Turn ``turn`` of ``s`` through the router, or straight to replica ``to``."""
        body = chat_body("model", s.messages(turn), max_tokens=self.max_tokens)
        if to is None:
            r = send(self.router, body, self.replicas, headers={"X-Session-ID": s.session_id})
        else:
            r = send(self.replicas[to], body, self.replicas)
        self.num_failed += r.error is not None
        row = {"phase": phase, "session": s.session_id, "turn": turn, **r.to_json()}
        if check and r.error is None and r.replica is not None:
            ref_body = chat_body("model", s.messages(turn), max_tokens=self.max_tokens,
                                 cache_salt=f"reference-{uuid.uuid4().hex}")
            ref = send(self.replicas[r.replica], ref_body, self.replicas)
            self.num_failed += ref.error is not None
            row["matches_reference"] = ref.error is None and ref.text == r.text
            self.num_mismatches += not row["matches_reference"]
        self.replies.append(row)
        return r

    def phase_sum(self, phase: str, key: str) -> int:
        return sum(r[key] for r in self.replies if r["phase"] == phase)


def run_faults(fleet: LocalFleet, replica_names: Sequence[str], sessions: Sequence[Session], *,
               password: str, max_tokens: int = 6, full_headroom_nbytes: int = 4 << 20,
               restart_timeout_s: float = 600.0) -> dict[str, Any]:
    """The phases above; ``sessions`` need at least 4 turns."""
    if len(sessions[0].observations) < 4:
        raise ValueError("the fault trace needs sessions of at least 4 turns")
    replicas = [fleet.url(n, 8000) for n in replica_names]
    clients = node_clients(fleet, password)
    c = Checked(fleet.url("router", 8000), replicas, max_tokens)
    out: dict[str, Any] = {}
    home: dict[str, int | None] = {}
    try:
        for turn in (0, 1):
            for s in sessions:
                home[s.session_id] = c.turn("warm", s, turn, check=False).replica
        out["num_keys_before_node_down"] = wait_cluster_quiet(clients)

        fleet.kill(NODES[1])
        errors_before = store_errors(replicas)
        for s in sessions:
            other = ((home[s.session_id] or 0) + 1) % len(replicas)
            c.turn("node_down", s, 2, to=other)
        out["node_down"] = {"store_errors": store_errors(replicas) - errors_before,
                            "orbitkv_tokens": c.phase_sum("node_down", "orbitkv_tokens"),
                            "prompt_tokens": c.phase_sum("node_down", "prompt_tokens")}
        fleet.start(NODES[1])
        fleet.wait_healthy(NODES[1], 60.0)
        wait_cluster_quiet(clients)

        counts = [sum(1 for r in home.values() if r == i) for i in range(len(replicas))]
        victim = max(range(len(replicas)), key=counts.__getitem__)
        returning = [s for s in sessions if home[s.session_id] == victim]
        fleet.stop(replica_names[victim])
        for s in returning:
            c.turn("replica_down", s, 2)
        t0 = time.perf_counter()
        fleet.start(replica_names[victim])
        fleet.wait_healthy(replica_names[victim], restart_timeout_s)
        out["replica_restart_s"] = round(time.perf_counter() - t0, 2)
        _wait_router_sees(c, returning[0], victim)
        wait_cluster_quiet(clients)
        for s in returning:
            c.turn("rejoined", s, 3)
        rejoined = [r for r in c.replies if r["phase"] == "rejoined"]
        out["replica_down_served_by"] = sorted(
            {r["replica"] for r in c.replies if r["phase"] == "replica_down"}, key=str)
        out["rejoined"] = {
            "num_sessions": len(rejoined),
            "num_back_on_replica": sum(r["replica"] == victim for r in rejoined),
            "prefix_cache_tokens": sum(r["prefix_cache_tokens"] for r in rejoined),
            "orbitkv_tokens": sum(r["orbitkv_tokens"] for r in rejoined),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rejoined),
        }

        evicted_before = cluster_stat(clients, "evicted_keys")
        errors_before = store_errors(replicas)
        limits = [cl.config_get("maxmemory")["maxmemory"] for cl in clients]
        for cl in clients:
            # Full, not misconfigured: room for a few chunks above what the node holds now, so
            # new writes evict old keys (below a node's own baseline a write would get OOM).
            used = int(cl.info("memory")["used_memory"])
            cl.config_set("maxmemory", used + full_headroom_nbytes)
        burst = make_sessions(len(sessions), 2, system_words=120, turn_words=60, seed=1,
                              prefix="burst")
        for turn in (0, 1):
            for s in burst:
                c.turn("memory_full", s, turn, check=turn == 1)
        wait_cluster_quiet(clients)
        out["memory_full"] = {"headroom_nbytes": full_headroom_nbytes,
                              "evicted_keys": cluster_stat(clients, "evicted_keys") - evicted_before,
                              "store_errors": store_errors(replicas) - errors_before}
        for cl, limit in zip(clients, limits, strict=True):
            cl.config_set("maxmemory", limit)
    finally:
        for cl in clients:
            cl.close()
    out["num_failed_requests"] = c.num_failed
    out["num_output_mismatches"] = c.num_mismatches
    out["num_checked_outputs"] = sum("matches_reference" in r for r in c.replies)
    out["replies"] = c.replies
    return out


def _wait_router_sees(c: Checked, probe: Session, victim: int, timeout_s: float = 120.0) -> None:
    """Until the router's health check has the replica back, its sessions go elsewhere: probe
    with a one-token request under a session key that lives there (not recorded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = chat_body("model", [{"role": "user", "content": "ping"}], max_tokens=1)
        r = send(c.router, body, c.replicas, headers={"X-Session-ID": probe.session_id})
        if r.replica == victim:
            return
        time.sleep(1.0)
