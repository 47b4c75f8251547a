"""Redis AUTH and TLS for the fleet's shared tier, against real redis-server processes.

- a wrong password is a start-up error naming ``remote_url`` (``orbitkv serve``, and the connector's
  store construction when vLLM is started directly), without the password in the message; a Redis
  that is merely down is not (its reads are misses);
- TLS (``rediss://``) against a ``redis-server --tls-port`` with certificates made here by openssl:
  entries round-trip; an untrusted certificate is a start-up error naming ``remote_url``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote, unquote

import pytest
import redis
import torch
from deploy_paths import DEPLOY
from hypothesis import example, given, settings
from hypothesis import strategies as st
from orbitkv.store.remote_check import OK, UNREACHABLE, check_remote
from redis_server import RedisServer, free_port, has_redis

from orbitkv.config import OrbitKVConfig, parse_remote_url

pytestmark = [pytest.mark.redis, pytest.mark.skipif(not has_redis(), reason="needs redis-server")]
SECRET = "pw-4d1f9c"


@pytest.fixture(scope="module")
def auth_redis():
    with RedisServer(password=SECRET) as server:
        yield server


@pytest.fixture
def serve_print_cmd(monkeypatch, capsys):
    """``orbitkv serve`` as the replicas run it (their config file, the URL in the environment),
    stopping before vLLM (``--print-cmd``): ``(exit status, stdout, stderr)``."""
    from orbitkv.serving import serve

    def run(remote_url: str) -> tuple[int, str, str]:
        monkeypatch.setenv("ORBITKV_REMOTE_URL", remote_url)
        capsys.readouterr()
        rc = serve.main(["--config", str(DEPLOY / "config" / "orbitkv.yaml"), "--print-cmd", "--",
                         "/models/model"])
        out = capsys.readouterr()
        return rc, out.out, out.err

    return run


def test_serve_refuses_a_wrong_password_at_start_up(auth_redis, serve_print_cmd):
    port = auth_redis.port
    rc, out, err = serve_print_cmd(f"redis://:wrong-{SECRET}@127.0.0.1:{port}")
    assert rc == 2 and "remote_url" in err and "refused the credentials" in err
    assert SECRET not in err + out
    rc, _, err = serve_print_cmd(f"redis://127.0.0.1:{port}")  # no password; the server wants one
    assert rc == 2 and "remote_url" in err
    rc, out, err = serve_print_cmd(f"redis://:{SECRET}@127.0.0.1:{port}")
    assert rc == 0, err
    # The printed command carries no secret: the URL stays in the environment.
    assert SECRET not in out and "--kv-transfer-config" in out


def test_a_down_redis_is_not_a_start_up_error(serve_print_cmd):
    port = free_port()
    rc, _, err = serve_print_cmd(f"redis://:{SECRET}@127.0.0.1:{port}")
    assert rc == 0, err
    assert check_remote(f"redis://:{SECRET}@127.0.0.1:{port}", timeout_s=0.5) == UNREACHABLE


def test_connector_store_construction_refuses_a_wrong_password(auth_redis):
    """vLLM started with --kv-transfer-config directly: the connector builds its store through
    runtime.acquire, which raises before any request could silently miss."""
    from orbitkv.connector import runtime

    cfg = OrbitKVConfig.load(overrides={"remote_url": f"redis://:nope@127.0.0.1:{auth_redis.port}",
                                        "local_cpu": True, "max_local_cpu_size": 0.01}, env={})
    with pytest.raises(ValueError, match="remote_url") as info:
        runtime.acquire(cfg)
    assert "nope" not in str(info.value)
    good = OrbitKVConfig.load(overrides={"remote_url": auth_redis.url, "max_local_cpu_size": 0.01}, env={})
    shared = runtime.acquire(good)
    try:
        assert shared.store.tier_names == ["memory", "redis"]
    finally:
        runtime.release(shared)


# -- TLS ---------------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "1", "-subj", "/CN=orbitkv-test-ca", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "ext.cnf", cwd=d)
    # A second CA that did not sign the server: a client trusting only it must refuse the server.
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out",
             "other.crt", "-days", "1", "-subj", "/CN=other-ca", cwd=d)
    port = free_port()
    server = RedisServer(free_port(), password=SECRET, extra_args=(
        "--tls-port", str(port), "--tls-cert-file", str(d / "server.crt"),
        "--tls-key-file", str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.crt"),
        "--tls-auth-clients", "no"))
    try:
        server.start()
    except RuntimeError:
        pytest.skip("this redis-server build has no TLS (--tls-port)")
    try:
        yield port, d
    finally:
        server.close()


def test_tls_round_trip_and_untrusted_certificate(tls_redis, serve_print_cmd):
    from orbitkv.store.entry import make_entry
    from orbitkv.store.tiered import TieredStore

    port, d = tls_redis
    url = f"rediss://:{SECRET}@127.0.0.1:{port}?ssl_ca_certs={d / 'ca.crt'}"
    assert check_remote(url) == OK
    cfg = OrbitKVConfig.load(overrides={"remote_url": url, "local_cpu": False}, env={})
    store = TieredStore.from_config(cfg)
    try:
        assert store.tier_names == ["redis"]
        k = torch.arange(2 * 2 * 4, dtype=torch.float32).reshape(2, 2, 4)
        entry = make_entry("canonical", {"k.0": k, "v.0": k + 1}, model_fingerprint="m" * 32,
                           layout="mha:float32")
        store.put("okv1:canonical:" + "a" * 32, entry)
        assert store.flush(30.0)
        (got,) = store.get(["okv1:canonical:" + "a" * 32])
        assert got is not None and torch.equal(got.tensors["k.0"], k) and torch.equal(got.tensors["v.0"], k + 1)
    finally:
        store.close()
    untrusted = f"rediss://:{SECRET}@127.0.0.1:{port}?ssl_ca_certs={d / 'other.crt'}"
    with pytest.raises(ValueError, match="remote_url: the TLS handshake") as info:
        check_remote(untrusted)
    assert SECRET not in str(info.value)
    rc, _, err = serve_print_cmd(untrusted)
    assert rc == 2 and "TLS" in err


def test_tls_cluster(tls_redis, tmp_path):
    """A three-master Redis Cluster over TLS only (client and cluster bus): ``rediss+cluster://``
    with the CA in the URL; an untrusted CA is a start-up error naming remote_url."""
    _, d = tls_redis
    nodes = []
    try:
        for _ in range(3):
            port = free_port(is_cluster=True)
            node = RedisServer(free_port(), password=SECRET, extra_args=(
                "--tls-port", str(port), "--tls-cluster", "yes", "--tls-replication", "yes",
                "--tls-cert-file", str(d / "server.crt"), "--tls-key-file", str(d / "server.key"),
                "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / f"{port}.conf"),
                "--cluster-port", str(port + 10000), "--masterauth", SECRET))
            node.tls_port = port
            nodes.append(node.start())
        subprocess.run(
            ["redis-cli", "--tls", "--cacert", str(d / "ca.crt"), "-a", SECRET, "--no-auth-warning",
             "--cluster", "create", *(f"127.0.0.1:{n.tls_port}" for n in nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60)
        url = f"rediss+cluster://:{SECRET}@127.0.0.1:{nodes[0].tls_port}?ssl_ca_certs={d / 'ca.crt'}"
        assert check_remote(url, timeout_s=5) == OK
        from orbitkv.store.redis_backend import RedisBackend

        deadline = time.monotonic() + 20
        while not all(redis.Redis(port=n.port, password=SECRET).cluster("info")["cluster_state"] == "ok"
                      for n in nodes):
            assert time.monotonic() < deadline, "the TLS cluster never reached cluster_state:ok"
            time.sleep(0.2)
        backend = RedisBackend(url)
        keys = [f"okv1:canonical:{i:032x}" for i in range(30)]
        backend.batch_put([(k, k.encode()) for k in keys])
        assert backend.batch_get(keys) == [k.encode() for k in keys]
        assert backend.stats().get("errors", 0) == 0
        backend.close()
        with pytest.raises(ValueError, match="remote_url: the TLS handshake"):
            check_remote(url.replace("ca.crt", "other.crt"), timeout_s=5)
        with pytest.raises(ValueError, match="remote_url: the Redis at .* refused the credentials"):
            check_remote(url.replace(SECRET, "wrong"), timeout_s=5)
    finally:
        for node in nodes:
            node.close()


def test_lmcache_interop_settings_fail_at_start_up(serve_print_cmd, monkeypatch):
    """lmcache_interop needs one Redis with LMCache's raw serde: anything else names the key."""
    from orbitkv.store.remote_check import check_config

    def cfg(**overrides):
        return OrbitKVConfig.load(overrides={"lmcache_interop": True, **overrides}, env={})

    with pytest.raises(ValueError, match="lmcache_interop: needs remote_url"):
        check_config(cfg())
    with pytest.raises(ValueError, match="lmcache_interop: remote_serde"):
        check_config(cfg(remote_url="redis://127.0.0.1:9", remote_serde="cachegen"))
    with pytest.raises(ValueError, match="lmcache_interop: remote_url must be one Redis"):
        check_config(cfg(remote_url="redis+cluster://127.0.0.1:9"))
    monkeypatch.setenv("ORBITKV_LMCACHE_INTEROP", "true")
    rc, _, err = serve_print_cmd("redis+cluster://127.0.0.1:9")
    assert rc == 2 and "lmcache_interop" in err


# -- the password stays secret (issue 25, item 9) ----------------------------------------------------

# A password with every character the URL syntax reserves; the URL carries it percent-encoded.
ODD_SECRET = "pw/4d?1f#9c@x:y%z"


@pytest.fixture(scope="module")
def odd_redis():
    with RedisServer(password=ODD_SECRET) as server:
        yield server


def _clear_orbitkv_env(monkeypatch) -> None:
    for name in [k for k in os.environ if k.startswith("ORBITKV_")]:
        monkeypatch.delenv(name)


def test_set_remote_url_reaches_vllm_by_environment_not_its_command_line(
    auth_redis, tmp_path, monkeypatch, capsys
):
    """``--set remote_url=redis://:PW@...``: vLLM's argv (``ps``) and the printed command carry no
    password; vLLM's environment does, and the config vLLM loads from both reaches the Redis."""
    from orbitkv.store.remote_check import check_config

    from orbitkv.serving import serve

    _clear_orbitkv_env(monkeypatch)
    monkeypatch.setenv("ORBITKV_REMOTE_URL", "redis://127.0.0.1:9")  # --set outranks it
    started = []
    monkeypatch.setattr(serve.os, "execve", lambda path, argv, env: started.append((argv, env)))
    argv = ["--store-dir", str(tmp_path / "store"), "--set", f"remote_url={auth_redis.url}", "--",
            "m"]
    capsys.readouterr()
    assert serve.main(argv) == 0
    (cmd, env), said = started[0], capsys.readouterr()
    assert SECRET not in " ".join(cmd) + said.out + said.err
    assert env["ORBITKV_REMOTE_URL"] == auth_redis.url
    extra = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    child = OrbitKVConfig.from_kv_connector_extra_config(extra, env=env)
    assert child.remote.password == SECRET and check_config(child) == OK
    assert serve.main(["--print-cmd", *argv]) == 0
    printed = capsys.readouterr().out
    assert SECRET not in printed
    assert f"ORBITKV_REMOTE_URL=redis://:***@127.0.0.1:{auth_redis.port}" in shlex.split(printed)


def test_model_servers_take_the_url_by_environment(auth_redis, tmp_path):
    from orbitkv.serving.server_process import model_server

    server = model_server(tmp_path / "model", "orbitkv", tmp_path / "log",
                          extra_config={"remote_url": auth_redis.url, "chunk_size": 64})
    assert SECRET not in " ".join(server.cmd)
    assert server.env["ORBITKV_REMOTE_URL"] == auth_redis.url
    ktc = json.loads(server.cmd[server.cmd.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector_extra_config"] == {"chunk_size": 64}
    from orbitkv.serving.server_process import split_secrets

    # Under the `orbitkv:` section or prefixed, too; a null (unsetting the key) stays.
    assert split_secrets({"orbitkv": {"remote_url": auth_redis.url, "tenant": "t"}}) == (
        {"orbitkv": {"tenant": "t"}}, {"ORBITKV_REMOTE_URL": auth_redis.url})
    assert split_secrets({"orbitkv_remote_url": auth_redis.url}) == (
        {}, {"ORBITKV_REMOTE_URL": auth_redis.url})
    assert split_secrets({"remote_url": None}) == ({"remote_url": None}, {})


@pytest.mark.parametrize("url", [
    f"redsi://:{SECRET}@127.0.0.1:6379",  # scheme
    f"redis://:{SECRET}@127.0.0.1:port",  # port
    f"redis://:{SECRET}@127.0.0.1:6379/db",  # database
    f"redis://:{SECRET}@:6379",  # host
    f"redis://:{SECRET}/x@127.0.0.1:6379",  # an unencoded "/" in the password
    f"redis://:{SECRET}?x@127.0.0.1:6379",
    f"redis://:{SECRET}?a=b@127.0.0.1:6379",
    f"redis://:{SECRET}#x@127.0.0.1:6379",
    f"redis://{SECRET}/x@127.0.0.1:6379",
])
def test_a_bad_url_is_an_error_naming_remote_url_without_the_password(url, monkeypatch, capsys):
    from orbitkv.store.redis_backend import RedisBackend

    from orbitkv.serving import serve

    with pytest.raises(ValueError, match="remote_url") as info:
        OrbitKVConfig.load(env={"ORBITKV_REMOTE_URL": url})
    assert SECRET not in str(info.value)
    _clear_orbitkv_env(monkeypatch)
    assert serve.main(["--store-dir", "/tmp/unused", "--set", f"remote_url={url}", "--print-cmd",
                       "--", "m"]) == 2
    said = capsys.readouterr()
    assert "remote_url" in said.err and SECRET not in said.out + said.err
    if url.startswith("redsi"):
        with pytest.raises(ValueError) as info:
            RedisBackend(url)
        assert SECRET not in str(info.value)


def test_a_password_with_reserved_characters_percent_encoded(odd_redis):
    from orbitkv.store.redis_backend import RedisBackend

    url = f"redis://:{quote(ODD_SECRET, safe='')}@127.0.0.1:{odd_redis.port}"
    cfg = OrbitKVConfig.load(env={"ORBITKV_REMOTE_URL": url})
    assert cfg.remote.password == ODD_SECRET and check_remote(cfg.remote_url) == OK
    assert cfg.remote.redacted_url == f"redis://:***@127.0.0.1:{odd_redis.port}"
    assert ODD_SECRET not in str(cfg.to_dict())
    backend = RedisBackend(cfg.remote_url)
    try:
        backend.batch_put([("okv1:canonical:" + "b" * 32, b"value")])
        assert backend.batch_get(["okv1:canonical:" + "b" * 32]) == [b"value"]
    finally:
        backend.close()
    raw = f"redis://:{ODD_SECRET}@127.0.0.1:{odd_redis.port}"  # not percent-encoded
    with pytest.raises(ValueError, match="remote_url: malformed URL .* percent-encode") as info:
        OrbitKVConfig.load(env={"ORBITKV_REMOTE_URL": raw})
    assert "4d" not in str(info.value)  # no part of the password either


@settings(max_examples=400, deadline=None)
@given(st.text(st.characters(exclude_categories=("Cs",)), max_size=24))
# Found by hypothesis in CI: an "@" before the "?" ("@?" was shown as "***@?@h", "@0?" read host "0").
@example("@?")
@example("@0?")
@example("x@/y")
def test_any_password_parses_percent_encoded_and_never_shows(password):
    encoded = parse_remote_url(f"redis://user:{quote(password, safe='')}@h:6379/1")
    assert (encoded.username, encoded.password, encoded.db) == ("user", password, 1)
    assert encoded.redacted_url == "redis://user:***@h:6379/1"
    assert parse_remote_url(encoded.url) == encoded  # the normalized form reads the same
    # Written raw: read by the percent rules, or a clear error; either way never shown.
    try:
        raw = parse_remote_url(f"redis://user:{password}@h:6379/1")
    except ValueError as exc:
        assert str(exc).startswith("remote_url: malformed URL 'redis://user:***@h:6379/1'")
        assert any(c in password for c in "/?#")
    else:
        assert raw.password == unquote(password) and raw.nodes == (("h", 6379),)
        assert raw.redacted_url == "redis://user:***@h:6379/1"


# -- rediss:// at a plain Redis (issue 25, item 10) -------------------------------------------------


def test_rediss_at_a_plain_redis_is_a_start_up_error(auth_redis, serve_print_cmd):
    url = f"rediss://:{SECRET}@127.0.0.1:{auth_redis.port}"
    with pytest.raises(ValueError, match="remote_url: .* answers plain Redis") as info:
        check_remote(url, timeout_s=0.5)
    assert SECRET not in str(info.value)
    rc, out, err = serve_print_cmd(url)
    assert rc == 2 and "remote_url" in err and "plain Redis" in err and SECRET not in out + err
    with RedisServer() as plain:  # without a password too
        with pytest.raises(ValueError, match="remote_url: .* answers plain Redis"):
            check_remote(f"rediss://127.0.0.1:{plain.port}", timeout_s=0.5)
    # Nothing listening is still only unreachable (a warning; reads are misses until it answers).
    assert check_remote(f"rediss://127.0.0.1:{free_port()}", timeout_s=0.5) == UNREACHABLE
