"""Redis ACL users from the compose file, on a real redis-server: a deployment reads and writes
only its own key prefix.

The compose file's ``redis-acl`` step writes Redis' ACL file; here its shell line runs as written,
with its own environment, once per deployment (A, then B's user line added, as deploy/README.md
tells a second deployment to do), and redis-server loads the file. A's store runs every command
OrbitKV uses as A's user, without an error; B, logged in as its own user, gets NOPERM on A's keys
and on server-wide commands, and a store of B's pointed at A's prefix reads nothing.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import redis
from deploy_paths import COMPOSE, ENV_EXAMPLE
from orbitkv.store.keys import EntryKey, antecedent_hash, chunk_cid, key_str
from orbitkv.store.remote_check import OK, check_remote
from orbitkv.store.tiered import TieredStore
from orbitkv_lab.fleet.compose import compose_env, load_compose
from redis_server import RedisServer, has_redis

from orbitkv.config import OrbitKVConfig

pytestmark = [pytest.mark.redis, pytest.mark.skipif(not has_redis(), reason="needs redis-server")]

ADMIN = "admin-pw"
USERS = {"alpha": ("alpha-pw", "fleet:alpha:"), "beta": ("beta-pw", "fleet:beta:")}


def _acl_lines(tmp_path, user: str) -> list[str]:
    """The ACL file the compose file's redis-acl step writes for one deployment's user."""
    password, prefix = USERS[user]
    env = compose_env(COMPOSE, {"REDIS_PASSWORD": ADMIN, "ORBITKV_REDIS_USER": user,
                                "ORBITKV_REDIS_PASSWORD": password,
                                "ORBITKV_REDIS_KEY_PREFIX": prefix}, env_file=ENV_EXAMPLE)
    step = load_compose(COMPOSE, env)["redis-acl"]
    out = tmp_path / user
    out.mkdir()
    assert step.argv[:2] == ("sh", "-c")
    script = step.argv[2].replace("/acl/", f"{out}/")
    subprocess.run(["sh", "-c", script], env={"PATH": os.environ["PATH"], **step.environment},
                   check=True, timeout=30)
    assert (out / "users.acl").stat().st_mode & 0o077 == 0  # the secrets are Redis' alone
    return (out / "users.acl").read_text().splitlines()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("acl")
    alpha, beta = _acl_lines(tmp_path, "alpha"), _acl_lines(tmp_path, "beta")
    assert alpha[0] == beta[0] and alpha[0].startswith("user default on >")
    acl_file = tmp_path / "users.acl"
    acl_file.write_text("\n".join([*alpha, beta[1]]) + "\n")
    with RedisServer(password=ADMIN, extra_args=("--aclfile", str(acl_file))) as s:
        yield s


def _url(server, user: str) -> str:
    return f"redis://{user}:{USERS[user][0]}@127.0.0.1:{server.port}"


def _store(server, user: str, tenant: str) -> TieredStore:
    cfg = OrbitKVConfig(local_cpu=False, remote_url=_url(server, user), remote_key_prefix="fleet:",
                        tenant=tenant, remote_ttl_s=3600)
    assert cfg.redis_key_prefix == f"fleet:{tenant}:"
    return TieredStore.from_config(cfg)


def _entry(seed: int, antecedent=()):
    import torch
    from orbitkv.store.entry import make_entry

    g = torch.Generator().manual_seed(seed)
    tensors = {f"{s}.0": torch.randn(4, 2, 8, generator=g).to(torch.bfloat16) for s in "kv"}
    kind = "conditioned" if antecedent else "canonical"
    return make_entry(kind, tensors, model_fingerprint="fp", layout="flash", antecedent=antecedent)


def test_a_deployment_runs_every_store_command_under_its_own_prefix(server):
    assert check_remote(_url(server, "alpha")) == OK  # the start-up check passes as the user
    cid = chunk_cid("fp", "flash", "alpha", [1, 2, 3])
    before = chunk_cid("fp", "flash", "alpha", [7])
    canonical = EntryKey(cid, "canonical")
    conditioned = EntryKey(cid, "conditioned", antecedent_hash([before]))
    with _store(server, "alpha", "alpha") as a:
        a.put(canonical, _entry(1))
        a.put(conditioned, _entry(2, [before]))  # its survivor index: a sorted set
        assert a.flush()
        assert a.lookup([canonical, conditioned]) == ["redis", "redis"]
        assert all(e is not None for e in a.get([canonical, conditioned]))
        assert a.batch_antecedents([cid]) == [[(before,)]]
        assert sorted(a.tiers[0].iter_keys())  # SCAN
        a.delete([canonical])
        assert a.lookup([canonical]) == [None]
        assert a.stats()["errors"] == 0
    admin = redis.Redis(port=server.port, password=ADMIN)
    assert admin.exists("fleet:alpha:" + key_str(conditioned))


def test_another_deployment_cannot_read_or_write_a_prefix_not_its_own(server):
    key = EntryKey(chunk_cid("fp", "flash", "alpha", [4, 5]), "canonical")
    with _store(server, "alpha", "alpha") as a:
        a.put(key, _entry(3))
        assert a.flush()
    name = "fleet:alpha:" + key_str(key)
    beta = redis.Redis(port=server.port, username="beta", password=USERS["beta"][0])
    assert beta.set("fleet:beta:mine", b"1") and beta.get("fleet:beta:mine") == b"1"
    for command in (
        lambda: beta.get(name),
        lambda: beta.set(name, b"forged"),
        lambda: beta.delete(name),
        lambda: beta.flushall(),
        lambda: beta.keys("*"),
        lambda: beta.config_get("requirepass"),
        lambda: beta.eval("return redis.call('GET', KEYS[1])", 1, name),
        lambda: beta.acl_list(),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    # B's store pointed at A's prefix (A's tenant, B's user): a miss, never an exception.
    with _store(server, "beta", "alpha") as b_as_a:
        assert b_as_a.lookup([key]) == [None] and b_as_a.get([key]) == [None]
    with _store(server, "alpha", "alpha") as a:
        assert a.get([key]) != [None]  # A's entry is untouched


def test_the_user_rules_serve_a_redis_cluster(tmp_path):
    """The redis-cluster profile's nodes load the same file: the cluster client's own commands
    (slot map, command table) are allowed too. The admin line is the test cluster's (no password,
    as its setup expects); the user's line is the compose step's."""
    from redis_server import RedisClusterServers

    user_line = _acl_lines(tmp_path, "alpha")[1]
    acl_file = tmp_path / "cluster.acl"
    acl_file.write_text(f"user default on nopass ~* &* +@all\n{user_line}\n")
    with RedisClusterServers(extra_args=("--aclfile", str(acl_file))) as cluster:
        url = f"redis+cluster://alpha:{USERS['alpha'][0]}@127.0.0.1:{cluster.nodes[0].port}"
        cfg = OrbitKVConfig(local_cpu=False, remote_url=url, remote_key_prefix="fleet:",
                            tenant="alpha", remote_ttl_s=3600)
        keys = [EntryKey(chunk_cid("fp", "flash", "alpha", [i]), "canonical") for i in range(8)]
        with TieredStore.from_config(cfg) as a:
            for i, key in enumerate(keys):  # spread over every node's slots
                a.put(key, _entry(i))
            assert a.flush()
            assert a.lookup(keys) == ["redis"] * len(keys)
            assert all(e is not None for e in a.get(keys))
            assert a.stats()["errors"] == 0
        other = redis.Redis(port=cluster.nodes[0].port, username="alpha", password=USERS["alpha"][0])
        with pytest.raises(redis.exceptions.NoPermissionError):
            other.get("fleet:beta:x")


def _compose_redis_flag(name: str) -> str:
    env = compose_env(COMPOSE, {"REDIS_PASSWORD": ADMIN, "ORBITKV_REDIS_PASSWORD": "x"},
                      env_file=ENV_EXAMPLE)
    argv = list(load_compose(COMPOSE, env)["redis"].argv)
    return argv[argv.index(name) + 1]


def test_a_deployment_hears_its_own_keys_removals_only(tmp_path):
    """Redis's own expiries reach a replica as its deployment's ACL user, under the compose
    file's flags, on its own prefix's keyspace channels; another deployment may not subscribe
    to them, nor to the keyevent channels that carry every tenant's key names."""
    import time

    from orbitkv.routing.redis_watch import RedisRemovalWatcher, channel_pattern

    alpha, beta = _acl_lines(tmp_path, "alpha"), _acl_lines(tmp_path, "beta")
    acl_file = tmp_path / "users.acl"
    acl_file.write_text("\n".join([*alpha, beta[1]]) + "\n")
    flags = _compose_redis_flag("--notify-keyspace-events")

    class Heard:
        def __init__(self):
            self.keys: list[str] = []

        def on_shared_lost(self, tier, keys):
            self.keys.extend(keys)

    with RedisServer(password=ADMIN, extra_args=("--aclfile", str(acl_file),
                                                 "--notify-keyspace-events", flags)) as s:
        heard = Heard()
        watcher = RedisRemovalWatcher(_url(s, "alpha"), "fleet:alpha:", heard)
        try:
            admin = redis.Redis(port=s.port, password=ADMIN)
            admin.set("fleet:alpha:mine", b"1", px=200)
            admin.set("fleet:beta:theirs", b"1", px=200)
            deadline = time.monotonic() + 10
            while "mine" not in heard.keys and time.monotonic() < deadline:
                admin.exists("fleet:alpha:mine", "fleet:beta:theirs")  # expiry on access too
                time.sleep(0.1)
            assert heard.keys == ["mine"]
        finally:
            watcher.close()
        beta_client = redis.Redis(port=s.port, username="beta", password=USERS["beta"][0])
        for pattern in (channel_pattern("fleet:alpha:"), "__keyevent@*__:expired"):
            pubsub = beta_client.pubsub()
            with pytest.raises(redis.exceptions.NoPermissionError):
                pubsub.psubscribe(pattern)
                pubsub.get_message(timeout=1.0)
            pubsub.close()
