"""kv-router as the compose file runs it, here as local processes in front of two real vLLM replicas
(tiny qwen2, seeded weights) and vllm-router:

- kv-router receives OrbitKV's tier events (memory ``CPU``, ``REDIS``) next to vLLM's GPU blocks;
- a request whose chunks one replica holds goes to that replica (a decision, not a fallback), and
  its greedy answer equals a full prefill's (a fresh ``cache_salt``) on the same replica;
- kv-router restarted knows nothing (every earlier event lost): the same request falls back to
  vllm-router (``no_holdings``) and still completes with the same answer.
"""

from __future__ import annotations

import secrets

import pytest
from deploy_paths import COMPOSE
from orbitkv_bench.fleet import REPLICAS, fleet_base_env, fleet_env, wait_replicas_quiet
from orbitkv_bench.fleet_routing import KV_ROUTER, front_counters
from orbitkv_lab.fleet.routing_trace import make_team_agents
from orbitkv_lab.fleet.runner import LocalFleet
from orbitkv_lab.fleet.sessions import chat_body, send
from redis_server import has_redis

from orbitkv.serving.http_client import scraped_label_totals

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.skipif(not has_redis(), reason="needs redis-server"),
]


@pytest.fixture(scope="module")
def fleet(tiny_qwen2, tmp_path_factory):
    env = fleet_env(tiny_qwen2, "qwen2", secrets.token_hex(16))
    with LocalFleet(COMPOSE, profiles={"cpu", "redis"}, env=env, workdir=tmp_path_factory.mktemp("fleet"),
                    base_env=fleet_base_env("all")) as f:
        f.up(timeout_s=300)
        yield f


def test_kv_router_routes_by_held_chunks_and_falls_back_after_lost_events(fleet):
    replicas = [fleet.url(n, 8000) for n in REPLICAS]
    front = fleet.url(KV_ROUTER, 8000)
    planner, verifier = make_team_agents(seed=5, num_teams=1, agents_per_team=2)

    def ask(url, messages, **kw):
        wait_replicas_quiet(fleet)
        return send(url, chat_body("model", messages, max_tokens=6, **kw), replicas,
                    headers={"X-Session-ID": secrets.token_hex(4)})

    first = ask(replicas[1], planner.messages(0, 5))  # replica 1 computes the team's chunks
    assert first.error is None and first.replica == 1

    def media() -> set[str]:
        return set(scraped_label_totals(front, "orbitkv_router_events_total", "medium"))

    # vLLM publishes a connector's events with an engine step: saves the background writer
    # finished after the request's last step go out with the replica's next step (docs/routing.md).
    for nudge in range(3):
        wait_replicas_quiet(fleet)
        if {"GPU", "CPU", "REDIS"} <= media():
            break
        ask(replicas[1], [{"role": "user", "content": f"ping {nudge}"}])
    assert {"GPU", "CPU", "REDIS"} <= media(), media()

    before = front_counters(front)
    routed = ask(front, verifier.messages(0, 5))  # the same system text and screenshots
    after = front_counters(front)
    assert routed.error is None and routed.replica == 1
    assert after.get("decisions", 0) == before.get("decisions", 0) + 1
    reference = ask(replicas[1], verifier.messages(0, 5), cache_salt=secrets.token_hex(8))
    assert routed.text == reference.text

    # kv-router tokenized with the model's own tokenizer (--tokenizer) and checked it against
    # the replica's /tokenize: equal.
    sources = scraped_label_totals(front, "orbitkv_router_tokenize_total", "source")
    assert sources.get("checked", 0) >= 1 and sources.get("mismatch", 0) == 0, sources

    fleet.restart(KV_ROUTER, 120)  # every event before this is lost to it
    fallback = ask(front, verifier.messages(0, 5))
    assert fallback.error is None and fallback.text == reference.text
    assert front_counters(front).get("fallback.no_holdings") == 1
