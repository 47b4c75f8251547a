"""``orbitkv bench fleet [--faults] [--routing [ARMS]] [--json]``: the compose fleet as local
processes, agent sessions through it (``--routing``: routing arms side by side, ``fleet_routing.py``).

Starts ``deploy/docker-compose.yml``'s ``redis`` and ``cpu`` profiles here (redis-server, two vLLM
replicas with OrbitKV on a tiny local qwen2, vllm-router with consistent_hash) with the services' own
commands and config files (``orbitkv_lab.fleet``), runs the fleet trace (``orbitkv_lab.fleet.trace``) and
prints its figures: sessions per replica, stickiness, the cross-replica hit rate, TTFT p50 of a moved
session vs one that stayed vs a cold prefill, failed requests and output mismatches.

``--faults`` runs the ``redis-cluster`` profile instead (three nodes) and the fault trace
(``orbitkv_lab.fleet.faults``): a node killed, a replica restarted, memory full.

Both replicas' OpenMP threads are bound to the same cores (``--cores``, through the environment the
services inherit; the compose file sets no binding of its own) and each replica's log is read back
(``bindings``, ``binding_check``): where they differ the TTFT figures are withheld. The replicas
also share those cores, so every request of the trace waits until neither replica is still busy with
the last one (``wait_replicas_quiet``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from orbitkv_lab.fleet.compose import compose_env
from orbitkv_lab.fleet.runner import LocalFleet
from orbitkv_lab.fleet.sessions import make_sessions
from orbitkv_lab.fleet.trace import run_trace

from orbitkv.agent.fairness import (
    add_cores_argument,
    binding_env,
    compare_bindings,
    is_cpu_platform,
    read_binding,
    session_cores,
    wait_quiet,
)

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "docker-compose.yml"
ENV_EXAMPLE = REPO / "deploy" / ".env.example"
REPLICAS = ("vllm-cpu-0", "vllm-cpu-1")


def fleet_env(models_dir: Path, model_name: str, password: str, **extra: str) -> dict[str, str]:
    """``.env.example`` with the model, a fresh password and a 1 GiB CPU KV cache."""
    return compose_env(COMPOSE, {
        "MODELS_DIR": str(models_dir), "MODEL": f"/models/{model_name}",
        "REDIS_PASSWORD": password, "VLLM_CPU_KVCACHE_SPACE": "1", **extra,
    }, env_file=ENV_EXAMPLE)


def wait_redis_quiet(url: str, quiet_s: float = 0.5, timeout_s: float = 30.0) -> int:
    """Wait until the key count stops changing (the replicas' write-behind queues drained)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        last, since = -1, time.monotonic()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            n = int(client.dbsize())
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
            time.sleep(0.1)
        return last
    finally:
        client.close()


def fleet_base_env(cores: str) -> dict[str, str]:
    """The environment every fleet process inherits: this one with the replicas' CPU binding."""
    return {**os.environ, **binding_env(cores)}


def wait_replicas_quiet(fleet: LocalFleet) -> float:
    """Wait until no replica is busy (vLLM polls for about a second after a request; OrbitKV
    saves to Redis in the background): the replicas share the cores, so a request timed while the
    other one is busy measures both. Returns the seconds waited."""
    procs = [fleet.processes.get(name) for name in REPLICAS]
    return sum(wait_quiet(p.proc.pid) for p in procs if p is not None and p.proc is not None)


def check_bindings(fleet: LocalFleet, result: dict[str, Any]) -> dict[str, Any]:
    """The replicas' bindings read back from their logs; TTFT figures withheld if they differ.

    With the engine's scheduler and worker in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    the cpu replicas' setting for OrbitKV's tier events) vLLM binds no OpenMP threads and logs
    none: the cores every thread of each replica may use are read from /proc instead."""
    bindings = {name: read_binding(fleet.log_path(name)) for name in REPLICAS}
    procs = {name: fleet.processes.get(name) for name in REPLICAS}
    if all(b is None for b in bindings.values()) and all(
            p is not None and p.proc is not None and p.env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
            for p in procs.values()):
        cores = {name: session_cores(p.proc.pid) for name, p in procs.items()}
        is_equal = None not in cores.values() and len({tuple(c) for c in cores.values()}) == 1
        check = {"is_equal": is_equal, "reason": None if is_equal else "the replicas' allowed cores differ",
                 "core_ids": cores, "how": "Cpus_allowed_list of every thread of each replica (/proc)"}
    else:
        check = compare_bindings(bindings, is_required=is_cpu_platform())
    result.update(bindings=bindings, binding_check=check)
    summary = result.get("summary") or {}
    if not check["is_equal"]:
        for key in [k for k in summary if k.startswith("ttft_")]:
            summary[key] = None
        result["ttft_withheld"] = check["reason"]
    return result


def local_fleet(workdir: Path, cores: str, *, is_cluster: bool = False,
                redis_maxmemory: str | None = None) -> tuple[LocalFleet, str]:
    """The compose fleet's cpu replicas (the tiny qwen2) with its single Redis or its Redis
    Cluster, as local processes, and the fresh Redis password they share. ``redis_maxmemory``:
    compose's ``REDIS_MAXMEMORY`` (the shared tier smaller than the fleet's working set)."""
    from orbitkv.models.make_model import make_model

    models = workdir / "models"
    make_model(models / "qwen2", "qwen2")
    password = secrets.token_hex(16)
    extra = ({"ORBITKV_REMOTE_URL": f"redis+cluster://:{password}@redis-node-0:6379"}
             if is_cluster else {})
    if redis_maxmemory is not None:
        extra["REDIS_MAXMEMORY"] = redis_maxmemory
    env = fleet_env(models, "qwen2", password, **extra)
    fleet = LocalFleet(COMPOSE, profiles={"cpu", "redis-cluster" if is_cluster else "redis"},
                       env=env, workdir=workdir / "fleet", base_env=fleet_base_env(cores))
    return fleet, password


def run(workdir: Path, *, num_sessions: int, num_turns: int, max_tokens: int, cores: str = "all") -> dict[str, Any]:
    fleet, password = local_fleet(workdir, cores)
    with fleet:
        t0 = time.perf_counter()
        fleet.up()
        startup_s = time.perf_counter() - t0
        redis_url = f"redis://:{password}@127.0.0.1:{fleet.port('redis', 6379)}"
        replicas = [fleet.url(name, 8000) for name in REPLICAS]
        sessions = make_sessions(num_sessions, num_turns)
        waited: list[float] = []
        result = run_trace(fleet.url("router", 8000), replicas, sessions, max_tokens=max_tokens,
                           settle=lambda: wait_redis_quiet(redis_url),
                           quiet=lambda: waited.append(wait_replicas_quiet(fleet)))
        result["quiet_wait_s"] = round(sum(waited), 2)
        result["num_redis_keys"] = wait_redis_quiet(redis_url)
        result["startup_s"] = round(startup_s, 2)
        logs = fleet.logs()
        check_bindings(fleet, result)
    result["is_password_in_logs"] = any(password in text for text in logs.values())
    return result


def run_faults_bench(workdir: Path, *, num_sessions: int, max_tokens: int, cores: str = "all") -> dict[str, Any]:
    from orbitkv_lab.fleet.faults import run_faults

    fleet, password = local_fleet(workdir, cores, is_cluster=True)
    with fleet:
        t0 = time.perf_counter()
        fleet.up()
        startup_s = time.perf_counter() - t0
        sessions = make_sessions(num_sessions, 4, system_words=120, turn_words=60, prefix="faults")
        result = run_faults(fleet, REPLICAS, sessions, password=password, max_tokens=max_tokens)
        logs = fleet.logs()
        check_bindings(fleet, result)
    result["startup_s"] = round(startup_s, 2)
    result["is_password_in_logs"] = any(password in text for text in logs.values())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="orbitkv bench fleet", description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--faults", action="store_true",
                   help="Redis Cluster profile: evictions, a node killed, a replica restarted")
    p.add_argument("--workdir", help="keep the fleet's logs and volumes here (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.add_argument("--routing", nargs="?", const="affinity,consistent_hash,kv_events,chunk_set",
                   help="routing arms side by side (orbitkv_bench.fleet_routing), comma-separated "
                   "from affinity, consistent_hash, kv_events, chunk_set (default: all four)")
    p.add_argument("--teams", type=int, default=2, help="--routing: agent teams measured")
    p.add_argument("--agents-per-team", type=int, default=2, help="--routing: agents sharing a team's screenshots")
    p.add_argument("--fault-teams", type=int, default=1, help="--routing: teams in the fault pass (0: none)")
    p.add_argument("--redis-maxmemory", help="--routing: the shared Redis' maxmemory (compose's "
                   "REDIS_MAXMEMORY, e.g. 4mb): smaller than the trace's working set, it evicts")
    add_cores_argument(p)
    args = p.parse_args(argv)
    if args.routing is not None:
        return _main_routing(p, args)
    if args.sessions < 2 or args.turns < 2:
        p.error("need at least 2 sessions and 2 turns")
    with tempfile.TemporaryDirectory(prefix="orbitkv-fleet-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        if args.faults:
            result = run_faults_bench(workdir, num_sessions=args.sessions, max_tokens=args.max_tokens,
                                      cores=args.cores)
        else:
            result = run(workdir, num_sessions=args.sessions, num_turns=args.turns,
                         max_tokens=args.max_tokens, cores=args.cores)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(json.dumps({k: v for k, v in result.items() if k != "replies"}, indent=2))
    ok = result.get("is_sticky", True) and not result["num_failed_requests"] and result["binding_check"]["is_equal"]
    return 0 if ok and not result["num_output_mismatches"] else 1


def _main_routing(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from orbitkv_bench.fleet_routing import ARMS, run_routing

    arms = tuple(a.strip() for a in args.routing.split(",") if a.strip())
    unknown = [a for a in arms if a not in ARMS]
    if unknown or len(set(arms)) != len(arms) or len(arms) < 2:
        p.error(f"--routing takes at least two distinct arms of {', '.join(ARMS)}; got {args.routing!r}")
    with tempfile.TemporaryDirectory(prefix="orbitkv-fleet-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        result = run_routing(workdir, arms=arms, num_teams=args.teams, agents_per_team=args.agents_per_team,
                             fault_teams=args.fault_teams, max_tokens=args.max_tokens, cores=args.cores,
                             is_faults=args.fault_teams > 0, redis_maxmemory=args.redis_maxmemory)
    if not args.json:
        result = {k: v for k, v in result.items() if k != "requests"}
    print(json.dumps(result, indent=2))
    ok = not result["num_failed_requests"] and not result["num_output_mismatches"]
    return 0 if ok and result["binding_check"]["is_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
