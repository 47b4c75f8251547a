"""OrbitKVConfig: sources and precedence, LMCache files, unknown keys and bad values."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from orbitkv.config import GB, OrbitKVConfig, parse_remote_url

# Real LMCache configs, verbatim. The first is the CacheRoute deployment's lmcache.yaml (Redis remote,
# sha256_cbor, cachegen serde); the second LMCache's own docs example for the encoder cache; the
# third a user config with LMCache features OrbitKV does not have (they must load and be ignored).
LMCACHE_CACHEROUTE = """\
chunk_size: 256
pre_caching_hash_algorithm: "sha256_cbor"

local_cpu: true
max_local_cpu_size: 80.0

remote_url: "redis://127.0.0.1:6379"
remote_serde: "cachegen"

local_disk: null
max_local_disk_size: 0

save_decode_cache: false
cache_policy: "LRU"
numa_mode: null
"""
LMCACHE_DOCS_EC = """\
chunk_size: 256
local_cpu: true
max_local_cpu_size: 2          # GiB
local_disk: "file:///var/lmcache/ec"
max_local_disk_size: 16        # GiB
"""
LMCACHE_FEATURES = """\
chunk_size: 256
save_unfull_chunk: true
local_cpu: true
max_local_cpu_size: 4.0
local_disk: "file:///home/noslab-gpu/tkdgjs/experiment/lmcache_cachegen_disk/"
max_local_disk_size: 10.0
remote_serde: cachegen
enable_async_loading: true
enable_kv_events: true
internal_api_server_enabled: true
internal_api_server_port_start: 6999
extra_config:
  tag_keys: ["user"]
"""


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults_and_derived_sizes() -> None:
    cfg = OrbitKVConfig.load(env={})
    assert (cfg.chunk_size, cfg.local_cpu, cfg.cache_policy) == (256, True, "LRU")
    assert (cfg.enable_exact, cfg.enable_survivor, cfg.enable_blind) == (True, True, False)
    assert cfg.save_canonical and cfg.tenant == "" and cfg.remote_url is None
    assert cfg.local_cpu_nbytes == 5 * GB
    assert cfg.local_disk_path is None and cfg.local_disk_nbytes == 0
    off = OrbitKVConfig(local_cpu=False, local_disk="file:///x/y", max_local_disk_size=0.5)
    assert off.local_cpu_nbytes == 0
    assert off.local_disk_path == Path("/x/y") and off.local_disk_nbytes == GB // 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_size = 1  # type: ignore[misc]


@pytest.mark.parametrize("text", [LMCACHE_CACHEROUTE, LMCACHE_DOCS_EC, LMCACHE_FEATURES])
def test_real_lmcache_files_load(tmp_path: Path, text: str) -> None:
    cfg = OrbitKVConfig.load(write(tmp_path, text), env={})
    assert cfg.chunk_size == 256 and cfg.local_cpu is True


def test_lmcache_keys_keep_their_meaning(tmp_path: Path) -> None:
    cfg = OrbitKVConfig.load(write(tmp_path, LMCACHE_CACHEROUTE), env={})
    assert cfg.max_local_cpu_size == 80.0 and cfg.local_cpu_nbytes == 80 * GB
    assert cfg.remote_url == "redis://127.0.0.1:6379" and cfg.remote_serde == "cachegen"
    assert cfg.pre_caching_hash_algorithm == "sha256_cbor"
    assert cfg.local_disk is None and cfg.local_disk_nbytes == 0
    assert cfg.ignored_lmcache_keys == ("numa_mode", "save_decode_cache")
    ec = OrbitKVConfig.load(write(tmp_path, LMCACHE_DOCS_EC), env={})
    assert ec.local_disk_path == Path("/var/lmcache/ec") and ec.local_disk_nbytes == 16 * GB
    feats = OrbitKVConfig.load(write(tmp_path, LMCACHE_FEATURES), env={})
    assert "extra_config" in feats.ignored_lmcache_keys
    assert "enable_async_loading" in feats.ignored_lmcache_keys


def test_orbitkv_section_and_prefix(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        chunk_size: 128
        orbitkv_tenant: acme
        orbitkv:
          enable_blind: true
          remote_ttl_s: 60
          anchor_tokens: [1, 2]
        """,
    )
    cfg = OrbitKVConfig.load(path, env={})
    assert (cfg.chunk_size, cfg.tenant, cfg.enable_blind) == (128, "acme", True)
    assert cfg.remote_ttl_s == 60.0 and cfg.anchor_tokens == (1, 2)
    twice = write(tmp_path, "orbitkv_tenant: a\norbitkv:\n  tenant: b\n", "twice.yaml")
    with pytest.raises(ValueError, match="tenant is set twice"):
        OrbitKVConfig.load(twice, env={})


def test_precedence_file_env_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 64\nlocal_cpu: false\norbitkv:\n  tenant: file\n")
    env = {"ORBITKV_CONFIG_FILE": str(path), "ORBITKV_TENANT": "env", "ORBITKV_PATCH_RANK": "4"}
    cfg = OrbitKVConfig.load(env=env)
    assert (cfg.chunk_size, cfg.local_cpu, cfg.tenant, cfg.patch_rank) == (64, False, "env", 4)
    cfg = OrbitKVConfig.load(env=env, overrides={"tenant": "over", "chunk_size": 32})
    assert (cfg.chunk_size, cfg.tenant, cfg.patch_rank) == (32, "over", 4)
    other = write(tmp_path, "chunk_size: 16\n", "other.yaml")
    assert OrbitKVConfig.load(other, env=env).chunk_size == 16  # an explicit path wins
    assert OrbitKVConfig.load(env={"LMCACHE_CONFIG_FILE": str(other)}).chunk_size == 16
    both = {"ORBITKV_CONFIG_FILE": str(path), "LMCACHE_CONFIG_FILE": str(other)}
    assert OrbitKVConfig.load(env=both).chunk_size == 64


def test_env_values_are_parsed() -> None:
    env = {
        "ORBITKV_LOCAL_CPU": "off",
        "ORBITKV_ENABLE_BLIND": "1",
        "ORBITKV_MAX_LOCAL_CPU_SIZE": "0.25",
        "ORBITKV_REMOTE_URL": "",
        "ORBITKV_ANCHOR_TOKENS": "1, 2,3",
        "ORBITKV_METRICS_PORT": "9400",
        "ORBITKV_LOG_LEVEL": "debug",
        "ORBITKV_SLOW": "1",  # tooling, not config
        "LMCACHE_CHUNK_SIZE": "7",  # LMCache's env vars are LMCache's business
    }
    cfg = OrbitKVConfig.load(env=env)
    assert (cfg.local_cpu, cfg.enable_blind, cfg.max_local_cpu_size) == (False, True, 0.25)
    assert cfg.request_tenants == ()
    assert cfg.remote_url is None and cfg.anchor_tokens == (1, 2, 3)
    assert (cfg.metrics_port, cfg.log_level, cfg.chunk_size) == (9400, "DEBUG", 256)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("bogus: 1\n", "unknown key 'bogus'"),
        ("tenant: x\n", "unknown top-level key 'tenant'.*orbitkv_tenant"),
        ("orbitkv:\n  bogus: 1\n", "unknown key orbitkv.bogus"),
        ("orbitkv_bogus: 1\n", "unknown key 'orbitkv_bogus'"),
        ("orbitkv: 3\n", "'orbitkv' must be a mapping"),
        ("- a\n- b\n", "expected a mapping"),
        ("chunk_size: [\n", "cannot load"),
    ],
)
def test_bad_files_name_the_key_and_file(tmp_path: Path, text: str, needle: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=needle) as info:
        OrbitKVConfig.load(path, env={})
    assert str(path) in str(info.value)


def test_an_empty_env_var_is_unset_and_tenants_keep_their_case(tmp_path: Path) -> None:
    """docker compose passes ``${ORBITKV_REQUEST_TENANTS:-}`` as an empty string: the file's value
    stands. Tenant names are compared as written."""
    path = write(tmp_path, "orbitkv:\n  request_tenants: [Acme, beta]\n  approximate_reuse: ALL\n")
    cfg = OrbitKVConfig.load(path, env={"ORBITKV_REQUEST_TENANTS": ""})
    assert cfg.request_tenants == ("Acme", "beta") and cfg.approximate_reuse == "all"
    cfg = OrbitKVConfig.load(path, env={"ORBITKV_REQUEST_TENANTS": "t1 t2"})
    assert cfg.request_tenants == ("t1", "t2")
    with pytest.raises(ValueError, match="approximate_reuse"):
        OrbitKVConfig.load(env={"ORBITKV_APPROXIMATE_REUSE": "sometimes"})


def test_unknown_env_and_override_keys() -> None:
    with pytest.raises(ValueError, match="env ORBITKV_BOGUS: unknown key 'bogus'"):
        OrbitKVConfig.load(env={"ORBITKV_BOGUS": "1"})
    with pytest.raises(ValueError, match="overrides: unknown key 'bogus'"):
        OrbitKVConfig.load(env={}, overrides={"bogus": 1})
    with pytest.raises(TypeError):
        OrbitKVConfig(bogus=1)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("chunk_size", 0, "chunk_size: 0 is out of range"),
        ("chunk_size", "abc", "chunk_size: expected int"),
        ("chunk_size", True, "chunk_size: expected int"),
        ("chunk_size", 2.5, "chunk_size: expected int"),
        ("max_local_cpu_size", -1, "max_local_cpu_size: -1 is out of range"),
        ("max_local_disk_size", "nan", "max_local_disk_size: expected a finite number"),
        ("local_cpu", "maybe", "local_cpu: expected a boolean"),
        ("cache_policy", "LFU", "cache_policy: expected one of"),
        ("local_disk", "relative/dir", "local_disk: expected 'file:///absolute/path'"),
        ("local_disk", "file:///a,file:///b", "local_disk: one directory"),
        ("remote_url", "http://host:1", "remote_url: unsupported URL"),
        ("remote_url", "redis://a:1,b:2", "remote_url: redis:// takes one host"),
        ("remote_url", "redis://h:notaport", "remote_url: bad host:port"),
        ("remote_url", "redis://h:1/x", "remote_url: bad database"),
        ("remote_serde", "pickle", "remote_serde: expected one of"),
        ("pre_caching_hash_algorithm", "md5", "pre_caching_hash_algorithm: expected one of"),
        ("log_level", "LOUD", "log_level: expected one of"),
        ("metrics_port", 70000, "metrics_port: 70000 is out of range"),
        ("remote_timeout_s", 0, "remote_timeout_s: 0 is out of range"),
        ("anchor_tokens", [1, -2], "anchor_tokens: token ids must be >= 0"),
        ("tenant", 5, "tenant: expected a string"),
    ],
)
def test_bad_values_name_the_key(key: str, value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        OrbitKVConfig.load(env={}, overrides={key: value})
    with pytest.raises(ValueError, match=needle):
        OrbitKVConfig(**{key: value})


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="env ORBITKV_CHUNK_SIZE: chunk_size: expected int"):
        OrbitKVConfig.load(env={"ORBITKV_CHUNK_SIZE": "lots"})


def test_bad_file_value_names_file_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, "orbitkv:\n  patch_rank: -1\n")
    with pytest.raises(ValueError, match=r"cfg.yaml: orbitkv.patch_rank: patch_rank: -1"):
        OrbitKVConfig.load(path, env={})


def test_remote_url_forms() -> None:
    plain = parse_remote_url("redis://127.0.0.1:6379")
    assert (plain.is_cluster, plain.is_tls, plain.nodes, plain.db) == (
        False,
        False,
        (("127.0.0.1", 6379),),
        0,
    )
    tls = parse_remote_url("rediss://user:s%40cret@cache.internal:6380/2")
    assert (tls.is_tls, tls.username, tls.password, tls.db) == (True, "user", "s@cret", 2)
    assert tls.redacted_url == "rediss://user:***@cache.internal:6380/2"
    ours = parse_remote_url("rediss+cluster://:pw@h1:7000")
    assert ours.is_cluster and ours.is_tls and ours.password == "pw"
    assert parse_remote_url("redis://h:1?cluster=1").is_cluster
    assert parse_remote_url("rediss+cluster://h1:1,h2:2").url == "rediss+cluster://h1:1"
    assert parse_remote_url("unix:///run/redis.sock").nodes == ()
    # LMCache's cluster spelling is rewritten to the store's, seeded from the first node.
    lm = parse_remote_url("redis-cluster://u:pw@h1:7000,h2:7001")
    assert lm.url == "redis+cluster://u:pw@h1:7000" and lm.is_cluster
    assert lm.nodes == (("h1", 7000), ("h2", 7001))
    cfg = OrbitKVConfig.load(env={}, overrides={"remote_url": "redis-cluster://h1:7000,h2:7001"})
    assert cfg.remote_url == "redis+cluster://h1:7000" and cfg.remote.is_cluster
    secret = OrbitKVConfig(remote_url="redis://:hunter2@h:1")
    assert "hunter2" not in str(secret.to_dict()) and secret.remote.password == "hunter2"


def test_kv_connector_extra_config(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 64\norbitkv:\n  tenant: file\n")
    extra = {"orbitkv_config_file": str(path), "orbitkv": {"tenant": "vllm"}, "local_cpu": False}
    cfg = OrbitKVConfig.from_kv_connector_extra_config(extra, env={})
    assert (cfg.chunk_size, cfg.tenant, cfg.local_cpu) == (64, "vllm", False)
    assert OrbitKVConfig.from_kv_connector_extra_config(None, env={}) == OrbitKVConfig()
    with pytest.raises(ValueError, match="unknown key 'lmcache_rpc_port'"):
        OrbitKVConfig.from_kv_connector_extra_config({"lmcache_rpc_port": 1}, env={})


def test_every_attribute_the_store_reads_exists() -> None:
    settings = pytest.importorskip("orbitkv.store.settings")
    cfg = OrbitKVConfig(local_disk="/tmp/okv", remote_url="redis://h:1", remote_ttl_s=5)
    missing = [name for name in settings.CONFIG_ATTRIBUTES if not hasattr(cfg, name)]
    assert missing == []
    built = settings.StoreSettings.from_config(cfg)
    assert built.memory_nbytes == cfg.local_cpu_nbytes and built.disk_dir == "/tmp/okv"
    assert built.disk_nbytes == cfg.local_disk_nbytes and built.redis_ttl_s == 5
    assert built.num_writer_threads == cfg.disk_writer_threads
    assert built.write_queue_depth == cfg.write_queue_depth


def test_retired_approximate_reuse_values_fail_naming_the_key_and_the_replacement():
    for value, hint in (("salted", "'request'"), ("shared", "'all'")):
        with pytest.raises(ValueError, match=rf"approximate_reuse.*{hint}"):
            OrbitKVConfig.load(overrides={"approximate_reuse": value}, env={})
    assert OrbitKVConfig.load(env={}).approximate_reuse == "off"
