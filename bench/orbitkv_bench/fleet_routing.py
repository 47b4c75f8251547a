"""``orbitkv bench fleet --routing affinity,consistent_hash,kv_events,chunk_set``: routing arms on one
fleet, side by side.

The compose fleet's ``cpu`` + ``redis`` profiles run here as local processes (``orbitkv_lab.fleet``):
two vLLM replicas with OrbitKV (``kv_events`` on, vLLM's publisher on each), vllm-router
(consistent hash), and kv-router (``orbitkv route``, chunk-set). The arms:

- ``affinity``: a session stays on the replica it was first placed on (fewest sessions), sent
  straight to it;
- ``consistent_hash``: vllm-router, keyed by ``X-Session-ID``;
- ``kv_events``: ``orbitkv route --policy prefix``, a second instance of kv-router's command: the
  longest prefix of vLLM's own GPU blocks from its events (what llm-d and Dynamo do), vllm-router
  when no replica holds any;
- ``chunk_set``: kv-router as deployed: OrbitKV's tier events, chunks anywhere, vllm-router
  when no replica holds any.

The trace (``orbitkv_lab.fleet.routing_trace``): agent teams sharing screenshots, windows that slide,
reorder and recall, sessions that move; the arms interleaved request by request, every request
waiting for quiet replicas (they share the cores). Then the fault pass, on other text: a replica
down for a step and restarted (its event sequence starts over: forgotten), both routing fronts
restarted (every event before lost: they fall back), Redis restarted (empty). Every request of
both passes is then replayed on the replica that served it with a fresh ``cache_salt`` (a full
prefill) and the greedy answers compared.
"""

from __future__ import annotations

import os
import secrets
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from orbitkv_lab.fleet.local import free_port
from orbitkv_lab.fleet.routing_trace import (
    STEPS,
    affinity_route,
    header_route,
    run_interleaved,
    summarize_arm,
)
from orbitkv_lab.fleet.runner import LocalFleet
from orbitkv_lab.fleet.sessions import chat_body, send

from orbitkv.serving.http_client import http_get, label_totals
from orbitkv_bench.fleet import (
    REPLICAS,
    check_bindings,
    local_fleet,
    wait_redis_quiet,
    wait_replicas_quiet,
)

ARMS = ("affinity", "consistent_hash", "kv_events", "chunk_set")
KV_ROUTER = "kv-router-cpu"


def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if http_get(url, "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f}s")


class PrefixFront:
    """kv-router's own command with ``--policy prefix`` on another port."""

    def __init__(self, fleet: LocalFleet, workdir: Path) -> None:
        argv = fleet.translator.argv(fleet.services[KV_ROUTER])
        argv[argv.index("--policy") + 1] = "prefix"
        self.port = free_port()
        argv[argv.index("--port") + 1] = str(self.port)
        self.argv, self.env = argv, fleet.translator.environment(fleet.services[KV_ROUTER], fleet.base_env)
        self.log_path = workdir / "logs" / "kv-router-prefix.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        _wait_http(self.url)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def front_counters(url: str) -> dict[str, float]:
    """The front's decisions and fallbacks, summed by reason (``/metrics``)."""
    try:
        status, text = http_get(url, "/metrics")
    except OSError:
        return {}
    if status != 200:
        return {}
    decisions = label_totals(text, "orbitkv_router_decisions_total", "replica")
    out = {f"fallback.{r}": n for r, n in label_totals(text, "orbitkv_router_fallbacks_total", "reason").items()}
    return {"decisions": sum(decisions.values()), **out} if decisions else out


def redis_stats(url: str) -> dict[str, Any]:
    """The shared tier after the measured pass: keys held, keys evicted at maxmemory, bytes."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        stats, memory = client.info("stats"), client.info("memory")
        return {"num_keys": int(client.dbsize()), "num_evicted_keys": int(stats["evicted_keys"]),
                "used_memory_nbytes": int(memory["used_memory"]),
                "maxmemory_nbytes": int(memory.get("maxmemory", 0))}
    finally:
        client.close()


def replay_references(records: list[dict[str, Any]], replica_urls: list[str], quiet) -> int:
    """Each request again on the replica that served it, a fresh cache_salt (a full prefill);
    marks ``reference_text`` and ``is_answer_equal``. Returns the number of mismatches."""
    mismatches = 0
    for r in records:
        if r["error"] is not None or r["replica"] is None:
            continue
        body = chat_body("model", r["body"]["messages"], max_tokens=r["body"]["max_tokens"],
                         cache_salt=f"reference-{secrets.token_hex(8)}")
        quiet()
        ref = send(replica_urls[r["replica"]], body, replica_urls)
        r["reference_text"] = ref.text if ref.error is None else None
        r["is_answer_equal"] = ref.error is None and ref.text == r["text"]
        mismatches += not r["is_answer_equal"]
    return mismatches


def paired_ratios(records: list[dict[str, Any]], arm: str, base: str) -> dict[str, Any] | None:
    """TTFT of ``arm`` over ``base`` per request pair (same step, same agent: the same shape on
    other text): median and quartiles, and the share of pairs where ``arm`` was faster."""
    by_key = {(r["arm"], r["step"], r["agent"]): r for r in records if r["error"] is None}
    ratios = [by_key[(arm, s, a)]["ttft_s"] / by_key[(base, s, a)]["ttft_s"]
              for (name, s, a) in by_key if name == arm and (base, s, a) in by_key
              and by_key[(base, s, a)]["ttft_s"] > 0]
    if len(ratios) < 2:
        return None
    q = statistics.quantiles(ratios, n=4)
    return {"num_pairs": len(ratios), "median": round(statistics.median(ratios), 4),
            "q1": round(q[0], 4), "q3": round(q[2], 4),
            "share_faster": round(sum(x < 1 for x in ratios) / len(ratios), 4)}


def run_routing(workdir: Path, *, arms: tuple[str, ...], num_teams: int, agents_per_team: int,
                fault_teams: int, max_tokens: int, cores: str = "all", is_faults: bool = True,
                redis_maxmemory: str | None = None) -> dict[str, Any]:
    fleet, password = local_fleet(workdir, cores, redis_maxmemory=redis_maxmemory)
    # The machine's load (other users' work shares the cores with the replicas): TTFT context.
    result: dict[str, Any] = {"arms": list(arms), "steps": [k for k, _ in STEPS],
                              "num_teams": num_teams, "agents_per_team": agents_per_team,
                              "redis_maxmemory": redis_maxmemory,
                              "load_average_1m_start": round(os.getloadavg()[0], 2)}
    with fleet:
        t0 = time.perf_counter()
        fleet.up()
        prefix = PrefixFront(fleet, workdir / "fleet")
        prefix.start()
        result["startup_s"] = round(time.perf_counter() - t0, 2)
        try:
            replica_urls = [fleet.url(n, 8000) for n in REPLICAS]
            fronts = {"kv_events": prefix.url, "chunk_set": fleet.url(KV_ROUTER, 8000)}
            makers = {
                "affinity": lambda: affinity_route(replica_urls),
                "consistent_hash": lambda: header_route("consistent_hash", fleet.url("router", 8000)),
                "kv_events": lambda: header_route("kv_events", fronts["kv_events"]),
                "chunk_set": lambda: header_route("chunk_set", fronts["chunk_set"]),
            }
            waits: list[float] = []

            def quiet() -> None:
                waits.append(wait_replicas_quiet(fleet))

            tally = FrontTally(fronts)
            records = run_interleaved([makers[a]() for a in arms], replica_urls, seed=0,
                                      num_teams=num_teams, agents_per_team=agents_per_team,
                                      steps=range(len(STEPS)), move_step=2, max_tokens=max_tokens,
                                      quiet=quiet)
            tally.mark()
            result["routing_front"] = tally.total
            redis_url = f"redis://:{password}@127.0.0.1:{fleet.port('redis', 6379)}"
            result["redis"] = redis_stats(redis_url)
            if is_faults:
                tally = FrontTally(fronts)
                faults = _faults(fleet, prefix, redis_url, tally)
                records += run_interleaved([makers[a]() for a in arms], replica_urls, seed=1,
                                           num_teams=fault_teams, agents_per_team=agents_per_team,
                                           steps=range(len(STEPS)), move_step=2, max_tokens=max_tokens,
                                           quiet=quiet, phase="faults", before_step=faults)
                tally.mark()
                result["routing_front_faults"] = tally.total
            result["num_output_mismatches"] = replay_references(records, replica_urls, quiet)
            result["quiet_wait_s"] = round(sum(waits), 2)
            result["load_average_1m_end"] = round(os.getloadavg()[0], 2)
            check_bindings(fleet, result)
        finally:
            prefix.stop()
    measured = [r for r in records if r["phase"] == "measure"]
    result["summary"] = {a: summarize_arm([r for r in measured if r["arm"] == a], len(REPLICAS)) for a in arms}
    result["faults"] = {a: summarize_arm([r for r in records if r["phase"] == "faults" and r["arm"] == a],
                                         len(REPLICAS)) for a in arms} if is_faults else None
    result["ttft_ratio_paired"] = {f"chunk_set/{b}": paired_ratios(measured, "chunk_set", b)
                                   for b in arms if b != "chunk_set" and "chunk_set" in arms}
    result["answers_equal_by_arm"] = {
        a: [sum(1 for r in records if r["arm"] == a and r.get("is_answer_equal")),
            sum(1 for r in records if r["arm"] == a and "is_answer_equal" in r)] for a in arms}
    result["num_failed_requests"] = sum(r["error"] is not None for r in records)
    result["requests"] = [{k: v for k, v in r.items() if k != "body"} for r in records]
    if not result["binding_check"]["is_equal"]:
        for s in result["summary"].values():
            s["ttft_p50_s"] = s["ttft_p95_s"] = None
        result["ttft_ratio_paired"] = None
    return result


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}


class FrontTally:
    """Decisions and fallbacks of the routing fronts over a pass, read before and after every
    step (a restarted front's counters start over: ``restarted``)."""

    def __init__(self, fronts: dict[str, str]) -> None:
        self.fronts = fronts
        self.total: dict[str, dict[str, float]] = {a: {} for a in fronts}
        self._last = {a: front_counters(u) for a, u in fronts.items()}

    def mark(self) -> None:
        for arm, url in self.fronts.items():
            now = front_counters(url)
            for k, v in _delta(self._last[arm], now).items():
                self.total[arm][k] = self.total[arm].get(k, 0.0) + v
            self._last[arm] = now

    def restarted(self) -> None:
        """The fronts were just restarted (after a ``mark``): their counters start over."""
        self._last = {a: front_counters(u) for a, u in self.fronts.items()}


def _faults(fleet: LocalFleet, prefix: PrefixFront, redis_url: str, tally: FrontTally):
    """Before step 1: replica 1 down; step 2: it restarts; step 3: both fronts restart (every
    event lost); step 4: Redis restarts, empty."""
    def before_step(step: int) -> None:
        tally.mark()
        if step == 1:
            fleet.stop(REPLICAS[1])
        elif step == 2:
            fleet.start(REPLICAS[1])
            fleet.wait_healthy(REPLICAS[1], 600)
            time.sleep(12)  # the router's health check (every 5 s, 2 successes) takes it back
        elif step == 3:
            prefix.stop()
            prefix.start()
            fleet.restart(KV_ROUTER, 120)
            tally.restarted()
        elif step == 4:
            fleet.restart("redis", 120)
            wait_redis_quiet(redis_url)
    return before_step
