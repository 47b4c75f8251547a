"""Redis AUTH and TLS for the fleet's shared tier, against real redis-server processes.

- a wrong password is a start-up error naming ``remote_url`` (``orbitkv serve``, and the connector's
  store construction when vLLM is started directly), without the password in the message; a Redis
  that is merely down is not (its reads are misses);
- TLS (``rediss://``) against a ``redis-server --tls-port`` with certificates made here by openssl:
  entries round-trip; an untrusted certificate is a start-up error naming ``remote_url``.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
import torch
from deploy_paths import DEPLOY
from orbitkv.store.remote_check import OK, UNREACHABLE, check_remote
from redis_server import RedisServer, free_port, has_redis

from orbitkv.config import OrbitKVConfig

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
