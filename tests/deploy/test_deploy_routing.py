"""The routing wiring of the compose file, without a Docker engine: every replica publishes its KV
events where kv-router subscribes, kv-router runs ``orbitkv route`` with the replicas' block size
and vllm-router as its fallback, the OrbitKV knob is a config field, and the dashboard's routing
panels read metrics the routing front exports (scraped from a real ``RoutingFront``)."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from deploy_paths import COMPOSE, DEPLOY, ENV_EXAMPLE
from orbitkv_lab.fleet.compose import compose_env, load_compose
from test_deploy_files import dashboard, dashboard_metric_names, flag

from orbitkv.config import OrbitKVConfig

ROUTERS = {"kv-router": ("gpu", ("vllm-0", "vllm-1")), "kv-router-cpu": ("cpu", ("vllm-cpu-0", "vllm-cpu-1"))}


@pytest.fixture(scope="module")
def services():
    env = compose_env(COMPOSE, {"REDIS_PASSWORD": "pw", "ORBITKV_REDIS_PASSWORD": "upw"}, env_file=ENV_EXAMPLE)
    return load_compose(COMPOSE, env)


def publisher_endpoint(argv) -> str:
    config = json.loads(flag(argv, "--kv-events-config"))
    assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
    return config["endpoint"]


def test_replicas_publish_events_on_an_exposed_port_with_kv_events_on(services):
    for name in ("vllm-0", "vllm-1", "vllm-cpu-0", "vllm-cpu-1"):
        svc = services[name]
        endpoint = publisher_endpoint(svc.argv[svc.argv.index("--") + 1 :])
        # vLLM binds only a wildcard endpoint ("*"); tcp://0.0.0.0:5557 would make it connect.
        port = int(re.fullmatch(r"tcp://\*:(\d+)", endpoint).group(1))
        assert port in svc.exposed_ports, name
    cfg = OrbitKVConfig.load(DEPLOY / "config" / "orbitkv.yaml", env={})
    assert cfg.kv_events is True


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_kv_router_subscribes_to_every_replica_with_its_block_size(services, name):
    profile, replicas = ROUTERS[name]
    svc = services[name]
    assert svc.profiles == (profile,)
    assert svc.argv[:2] == ("orbitkv", "route") and flag(svc.argv, "--policy") == "chunk_set"
    vllm_options = yaml.safe_load((DEPLOY / "config" / f"vllm-{profile}.yaml").read_text())
    assert int(flag(svc.argv, "--block-size")) == vllm_options["block-size"]
    assert flag(svc.argv, "--fallback-url") == "http://router:8000"
    # The front's own tokenizer is the model the replicas serve, from the same mount.
    replica = services[replicas[0]]
    assert flag(svc.argv, "--tokenizer") == replica.argv[replica.argv.index("--") + 1]
    assert {m.target for m in svc.mounts} >= {"/models"}
    assert {m.source for m in svc.mounts if m.target == "/models"} == {
        m.source for m in replica.mounts if m.target == "/models"}
    assert "router" in svc.depends_on
    specs = [svc.argv[i + 1] for i, a in enumerate(svc.argv) if a == "--replica"]
    names = {n: s for s in services.values() if profile in s.profiles for n in (s.name, *s.aliases)}
    router_workers = services["router"].argv
    for spec, replica in zip(specs, replicas, strict=True):
        url, endpoint = spec.rsplit("=", 1)
        assert url in router_workers  # the same names the fallback router proxies to
        host, port = re.fullmatch(r"tcp://([\w-]+):(\d+)", endpoint).groups()
        assert names[host].name == replica
        assert int(port) in services[replica].exposed_ports
        assert endpoint.rsplit(":", 1)[1] == publisher_endpoint(services[replica].argv).rsplit(":", 1)[1]
    if profile == "cpu":
        assert svc.aliases == ("kv-router",)  # Prometheus scrapes one name in both profiles


def test_kv_router_command_parses():
    from orbitkv.routing import service

    with pytest.raises(SystemExit) as exc:
        service.main(["--help"])
    assert exc.value.code == 0
    with pytest.raises(SystemExit) as exc:
        service.main(["--block-size", "16", "--replica", "no-endpoint"])
    assert exc.value.code == 2


def test_dashboard_routing_panels_read_exported_metrics():
    """The panels' orbitkv_router_* names are what a RoutingFront with an event feed exports."""
    from prometheus_client.parser import text_string_to_metric_families

    from orbitkv.routing.front import RoutingFront
    from orbitkv.routing.scorer import ChunkSetScorer

    class Feed:  # the EventFeed's counters, as its _receive fills them
        events_by_kind = {("r0", "BlockStored", "CPU"): 3}
        batches_by_replica = {"r0": 2}
        gaps_by_replica = {"r0": 1}

    front = RoutingFront(ChunkSetScorer(16), ["r0"], "http://router", "chunk_set", feed=Feed())
    front.decisions.labels("chunk_set", "r0").inc()
    front.fallbacks.labels("chunk_set", "tie").inc()
    front.forward_errors.labels("r0").inc()
    exported = {s.name for fam in text_string_to_metric_families(front.metrics().decode())
                for s in fam.samples}
    used = {n for n in dashboard_metric_names() if n.startswith("orbitkv_router_")}
    assert used and used <= exported, used - exported
    titles = " ".join(p["title"].lower() for p in dashboard()["panels"])
    for topic in ("routing decisions", "routing fallbacks", "kv events"):
        assert topic in titles, topic


def test_local_fleet_binds_each_publisher_on_its_own_port_where_kv_router_subscribes(services, tmp_path):
    """The local runner (orbitkv_lab.fleet) keeps the "*" vLLM needs to bind and moves the port."""
    from orbitkv_lab.fleet.local import Translator

    active = {n: s for n, s in services.items() if s.is_active({"cpu", "redis"})}
    t = Translator(active, tmp_path)
    subscribed = [a.split("=", 1)[1] for a in t.argv(active["kv-router-cpu"]) if a.startswith("http://")
                  and "=tcp://" in a]
    for name, endpoint in zip(("vllm-cpu-0", "vllm-cpu-1"), subscribed, strict=True):
        argv = t.argv(active[name])
        bound = publisher_endpoint(argv[argv.index("--") + 1 :])
        port = t.port(name, 5557)
        assert bound == f"tcp://*:{port}" and endpoint == f"tcp://127.0.0.1:{port}"
