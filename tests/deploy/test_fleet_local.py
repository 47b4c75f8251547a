"""The compose fleet, run here as local processes with the services' own commands and config files.

``deploy/docker-compose.yml``'s ``redis`` + ``cpu`` profiles: redis-server, two vLLM replicas
(``orbitkv serve`` on the tiny qwen2, seeded safetensors weights, so both replicas compute the same
KV) and vllm-router with consistent_hash in front (``orbitkv_lab.fleet`` translates only addresses,
mounted paths and executables; every process listens on loopback). One fleet for the module:

- sessions through the router stay on one replica each;
- a session moved to the other replica is served the chunks the first one computed, through Redis,
  and its greedy output equals a full prefill's on that replica (a fresh ``cache_salt``);
- the Redis password appears in no log and no /metrics, the dashboard's OrbitKV metrics are on the
  replicas' /metrics;
- Redis killed: requests still complete, correctly, and the replicas count store errors.

The figures (cross-replica hit rate, TTFT p50 moved vs staying) are printed as JSON; the same trace
at a larger size is ``orbitkv bench fleet --json``.
"""

from __future__ import annotations

import json
import re
import secrets
import time

import pytest
from deploy_paths import COMPOSE
from orbitkv_bench.fleet import (
    REPLICAS,
    check_bindings,
    fleet_base_env,
    fleet_env,
    wait_redis_quiet,
    wait_replicas_quiet,
)
from orbitkv_lab.fleet.runner import LocalFleet
from orbitkv_lab.fleet.sessions import chat_body, make_sessions, send
from orbitkv_lab.fleet.trace import run_trace
from redis_server import has_redis

from orbitkv.serving.http_client import http_get

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.skipif(not has_redis(), reason="needs redis-server"),
]
PASSWORD = secrets.token_hex(16)


@pytest.fixture(scope="module")
def fleet(tiny_qwen2, tmp_path_factory):
    # The tenants these tests pick per request are allowed by the deployment.
    env = fleet_env(tiny_qwen2, "qwen2", PASSWORD, ORBITKV_REQUEST_TENANTS="tenant-a tenant-b team-1")
    with LocalFleet(COMPOSE, profiles={"cpu", "redis"}, env=env, workdir=tmp_path_factory.mktemp("fleet"),
                    base_env=fleet_base_env("all")) as f:
        f.up(timeout_s=300)
        yield f


@pytest.fixture(scope="module")
def trace(fleet):
    replicas = [fleet.url(n, 8000) for n in REPLICAS]
    redis_url = f"redis://:{PASSWORD}@127.0.0.1:{fleet.port('redis', 6379)}"
    sessions = make_sessions(4, 2, system_words=110, turn_words=50, seed=7)
    waits: list[float] = []
    result = run_trace(fleet.url("router", 8000), replicas, sessions, max_tokens=6,
                       settle=lambda: wait_redis_quiet(redis_url),
                       quiet=lambda: waits.append(wait_replicas_quiet(fleet)))
    result["quiet_waits"] = waits
    print(json.dumps({"fleet_trace": result["summary"], "sessions_per_replica": result["sessions_per_replica"]}))
    return result


def test_processes_run_the_compose_commands(fleet):
    for name in REPLICAS:
        argv = fleet.processes[name].argv
        assert argv[1:4] == ["serve", "--config", str(COMPOSE.parent / "config" / "orbitkv.yaml")]
        assert argv[argv.index("--", 4) + 2 : argv.index("--", 4) + 4] == [
            "--config", str(COMPOSE.parent / "config" / "vllm-cpu.yaml")]
    router = fleet.processes["router"].argv
    assert router[router.index("--policy") + 1] == "consistent_hash"
    assert fleet.processes["redis"].argv[fleet.processes["redis"].argv.index("--bind") + 1] == "127.0.0.1"


def test_every_request_waits_until_both_replicas_are_quiet(trace):
    # wait_quiet watches each replica's process session for at least one window (0.3 s): a wait
    # shorter than two windows means a replica's processes were not found, and the timed request
    # would share the cores with the other replica's busy-polling and background saves.
    assert len(trace["quiet_waits"]) == len(trace["replies"])
    assert min(trace["quiet_waits"]) >= 2 * 0.3


def test_replicas_compute_on_the_same_cores(fleet):
    from orbitkv.agent.fairness import allowed_cores

    result = check_bindings(fleet, {"summary": {"ttft_p50_moved_s": 0.1}})
    assert result["binding_check"]["is_equal"], result["binding_check"]
    if all(b is None for b in result["bindings"].values()):
        # The engine in one process (the cpu replicas' setting): no OpenMP binding is logged, the
        # threads' allowed cores are read from /proc.
        assert all(c == allowed_cores() for c in result["binding_check"]["core_ids"].values())
    else:
        assert all(b["core_ids"] == [allowed_cores()] for b in result["bindings"].values())
    assert result["summary"]["ttft_p50_moved_s"] == 0.1 and "ttft_withheld" not in result


def test_sessions_stick_and_moved_sessions_hit_through_redis(trace):
    assert trace["num_failed_requests"] == 0
    assert trace["is_sticky"], trace["replies"]
    assert sum(trace["sessions_per_replica"]) == 4
    s = trace["summary"]
    assert s["num_moved"] == 2 and s["num_stay"] == 2
    moved = [r for r in trace["replies"] if r["kind"] == "moved"]
    for r in moved:
        # The replica never saw this session: no prefix-cache hit, the history came from Redis.
        assert r["prefix_cache_tokens"] == 0 and r["orbitkv_tokens"] >= 256, r
    assert s["cross_replica_hit_rate_of_history"] > 0.5
    stay = [r for r in trace["replies"] if r["kind"] == "stay"]
    assert all(r["prefix_cache_tokens"] + r["orbitkv_tokens"] > 0 for r in stay)
    cold = [r for r in trace["replies"] if r["kind"] == "cold"]
    assert len(cold) == 4 and all(r["prefix_cache_tokens"] == r["orbitkv_tokens"] == 0 for r in cold)
    # Greedy outputs of reused and fully prefilled prompts are equal, token for token.
    assert trace["num_output_mismatches"] == 0, trace["mismatches"]


def test_no_secret_in_logs_or_metrics_and_dashboard_metrics_exist(fleet, trace):
    from test_deploy_files import dashboard, dashboard_metric_names

    texts = dict(fleet.logs())
    for name in REPLICAS:
        status, text = http_get(fleet.url(name, 8000), "/metrics")
        assert status == 200
        texts[f"{name} /metrics"] = text
    status, texts["router /metrics"] = http_get(fleet.url("router", 29000), "/metrics")
    assert status == 200
    status, texts["kv-router /metrics"] = http_get(fleet.url("kv-router-cpu", 8000), "/metrics")
    assert status == 200
    for where, text in texts.items():
        assert PASSWORD not in text, f"the Redis password is in {where}"
    replica_metrics = texts[f"{REPLICAS[0]} /metrics"] + texts[f"{REPLICAS[1]} /metrics"]
    for name in dashboard_metric_names():
        family = name.removesuffix("_total").removesuffix("_bucket")
        source = (texts["router /metrics"] if name.startswith("vllm_router")
                  else texts["kv-router /metrics"] if name.startswith("orbitkv_router")
                  else replica_metrics)
        assert f"# HELP {family}" in source or f"\n{name}" in source, name
    assert 'vllm:orbitkv_hit_tokens_total{engine="0",model_name="model",tier="redis"}' in replica_metrics
    # The dashboard's replica picker lists the instances of a vLLM metric.
    (variable,) = dashboard()["templating"]["list"]
    picked = re.match(r"label_values\((vllm:\w+)\{", variable["query"]["query"]).group(1)
    assert f"# HELP {picked} " in replica_metrics


def _on(fleet, replica: int, session, **isolation):
    replicas = [fleet.url(n, 8000) for n in REPLICAS]
    body = chat_body("model", session.messages(0), max_tokens=4, **isolation)
    reply = send(replicas[replica], body, replicas)
    assert reply.error is None and reply.replica == replica
    wait_redis_quiet(f"redis://:{PASSWORD}@127.0.0.1:{fleet.port('redis', 6379)}")
    return reply


@pytest.mark.parametrize("key", ["cache_salt", "tenant"])
def test_tenants_never_hit_each_other_across_replicas(fleet, trace, key):
    """One prompt computed on replica 0 for tenant A: replica 1 serves it to A (through Redis),
    never to B. Each check uses its own prompt, so replica 1's prefix cache holds nothing of it."""
    shared, private = make_sessions(2, 1, system_words=60, turn_words=20, seed=11, prefix=key)
    for session in (shared, private):
        _on(fleet, 0, session, **{key: "tenant-a"})
    assert _on(fleet, 1, shared, **{key: "tenant-a"}).orbitkv_tokens >= 256
    other = _on(fleet, 1, private, **{key: "tenant-b"})
    assert other.orbitkv_tokens == 0 and other.prefix_cache_tokens == 0


def test_tenant_and_cache_salt_together_isolate(fleet, trace):
    (session,) = make_sessions(1, 1, system_words=60, turn_words=20, seed=12, prefix="both")
    _on(fleet, 0, session, tenant="team-1", cache_salt="user-1")
    assert _on(fleet, 1, session, tenant="team-1", cache_salt="user-2").orbitkv_tokens == 0
    # The same tenant and salt on the other replica does hit, through Redis.
    assert _on(fleet, 1, session, tenant="team-1", cache_salt="user-1").orbitkv_tokens >= 256


def test_redis_down_is_a_miss_and_requests_complete(fleet, trace):
    replicas = [fleet.url(n, 8000) for n in REPLICAS]
    fleet.kill("redis")
    (session,) = make_sessions(1, 1, system_words=60, turn_words=20, seed=99, prefix="down")
    body = chat_body("model", session.messages(0), max_tokens=6)
    got = send(fleet.url("router", 8000), body, replicas, headers={"X-Session-ID": session.session_id})
    assert got.error is None and got.replica is not None
    ref = send(replicas[got.replica], chat_body("model", session.messages(0), max_tokens=6,
                                                cache_salt="reference-down"), replicas)
    assert ref.error is None and ref.text == got.text
    # The failed writes behind the requests are counted as store errors (a miss, not a failure).
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        _, text = http_get(replicas[got.replica], "/metrics")
        if 'kind="store_errors"' in text:
            break
        time.sleep(0.5)
    assert 'vllm:orbitkv_errors_total{engine="0",kind="store_errors",model_name="model"}' in text
