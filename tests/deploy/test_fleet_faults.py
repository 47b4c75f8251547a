"""Fleet faults on the compose file's three-node Redis Cluster, run here as local processes.

``redis-cluster`` + ``cpu`` profiles: three cluster nodes and the one-shot cluster-create (the
compose commands), two vLLM replicas with OrbitKV on ``redis+cluster://``, vllm-router in front.
The trace (``orbitkv_lab.fleet.faults``): a node SIGKILLed (its slots are misses, the other nodes still
serve moved sessions), a replica restarted mid-trace (no request fails; it rejoins the ring and
hits in Redis), every node's maxmemory lowered far below the KV (allkeys-lru evicts, no store
error). Every measured output equals a full prefill's. Several minutes on 2 cores: ``slow``.
"""

from __future__ import annotations

import json
import secrets

import pytest
from deploy_paths import COMPOSE
from orbitkv_bench.fleet import REPLICAS, fleet_env
from orbitkv_lab.fleet.faults import run_faults
from orbitkv_lab.fleet.runner import LocalFleet
from orbitkv_lab.fleet.sessions import make_sessions
from redis_server import has_redis

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.skipif(not has_redis(), reason="needs redis-server"),
]


def test_cluster_node_down_replica_restart_and_memory_full(tiny_qwen2, tmp_path):
    password = secrets.token_hex(16)
    env = fleet_env(tiny_qwen2, "qwen2", password,
                    ORBITKV_REMOTE_URL=f"redis+cluster://:{password}@redis-node-0:6379")
    with LocalFleet(COMPOSE, profiles={"cpu", "redis-cluster"}, env=env, workdir=tmp_path) as fleet:
        fleet.up(timeout_s=600)
        assert "cluster_state:ok" in fleet.processes["redis-cluster-init"].argv[-1]
        sessions = make_sessions(5, 4, system_words=110, turn_words=50, seed=3, prefix="faults")
        result = run_faults(fleet, REPLICAS, sessions, password=password)
        logs = fleet.logs()
    print(json.dumps({k: v for k, v in result.items() if k != "replies"}))
    assert result["num_failed_requests"] == 0, [r for r in result["replies"] if r["error"]]
    assert result["num_output_mismatches"] == 0 and result["num_checked_outputs"] >= 15
    down = result["node_down"]
    assert down["store_errors"] > 0  # the dead node's slots were asked for and counted
    # Moved sessions still found their history's chunks on the two live nodes.
    assert 0 < down["orbitkv_tokens"] < down["prompt_tokens"]
    back = result["rejoined"]
    assert back["num_back_on_replica"] == back["num_sessions"] > 0
    assert back["prefix_cache_tokens"] == 0 and back["orbitkv_tokens"] > 0
    full = result["memory_full"]
    assert full["evicted_keys"] > 0 and full["store_errors"] == 0
    assert not any(password in text for text in logs.values())
