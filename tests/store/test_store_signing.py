"""Two deployments share one real redis-server: neither serves what the other wrote.

Deployment A and deployment B each have their own tenant (so their own Redis key prefix) and
their own entry-signing key. B is the adversary and, in the worst case here, holds the Redis
password (no ACL): it forges entries under A's keys (signed with its own key, unsigned with valid
checksums, or A's own signed entry copied to another key) and reads through A's prefix. A serves
none of them, and does not delete them (they are not A's to trust). ``tests/deploy/
test_redis_acl.py`` adds the ACL users that keep B out of A's prefix altogether.
"""

from __future__ import annotations

import pytest
import redis
from orbitkv.store.entry import encode
from orbitkv.store.keys import key_str
from orbitkv.store.signing import MAGIC, TRAILER_NBYTES, Signer
from orbitkv.store.tiered import TieredStore
from store_testing import canonical, canonical_key, same_tensors

from orbitkv.config import OrbitKVConfig

pytestmark = pytest.mark.redis


def _key_file(tmp_path, name: str, secret: bytes):
    path = tmp_path / f"{name}.key"
    path.write_bytes(secret + b"\n")
    return path


def _deployment(url: str, tenant: str, key_file) -> TieredStore:
    # No memory tier: every read goes to Redis, as on another replica.
    cfg = OrbitKVConfig(local_cpu=False, remote_url=url, remote_key_prefix="fleet:", tenant=tenant,
                        entry_signing_key_file=str(key_file))
    return TieredStore.from_config(cfg)


@pytest.fixture
def deployments(redis_password_server, tmp_path):
    url = redis_password_server.url
    key_a = _key_file(tmp_path, "a", b"alpha-secret-0123456789abcdef")
    key_b = _key_file(tmp_path, "b", b"beta-secret-0123456789abcdef")
    with (
        _deployment(url, "alpha", key_a) as a,
        _deployment(url, "beta", key_b) as b,
        # B configured with A's tenant (A's prefix) but only its own key.
        _deployment(url, "alpha", key_b) as b_as_a,
    ):
        yield a, b, b_as_a, redis.Redis.from_url(url)


def test_each_deployment_writes_under_its_own_prefix_and_signs(deployments):
    a, b, _, raw = deployments
    key = canonical_key(1)
    a.put(key, canonical(1))
    assert a.flush()
    value = raw.get("fleet:alpha:" + key_str(key))
    assert value is not None and raw.get(key_str(key)) is None
    assert value[-TRAILER_NBYTES:-TRAILER_NBYTES + len(MAGIC)] == MAGIC
    assert value[:-TRAILER_NBYTES] == encode(canonical(1))
    (got,) = a.get([key])
    assert got is not None and same_tensors(got.tensors, canonical(1).tensors)
    assert b.get([key]) == [None]  # B's own prefix holds nothing of A's


def test_a_forged_or_foreign_entry_is_a_miss_and_is_left_alone(deployments):
    a, _, b_as_a, raw = deployments
    key, other = canonical_key(2), canonical_key(3)
    name = "fleet:alpha:" + key_str(key)
    a.put(key, canonical(2))
    a.put(other, canonical(3))
    assert a.flush()
    # B reads A's entries through A's prefix: it cannot verify them, so it serves none.
    assert b_as_a.get([key]) == [None]

    forgeries = {
        "signed with B's key": lambda: (b_as_a.put(key, canonical(9)), b_as_a.flush()),
        "unsigned, valid checksums": lambda: raw.set(name, encode(canonical(9))),
        "A's own entry under another key": lambda: raw.set(name, raw.get("fleet:alpha:" + key_str(other))),
        "A's entry, tag cut off": lambda: raw.set(name, raw.get(name)[:-TRAILER_NBYTES]),
    }
    for what, forge in forgeries.items():
        a.put(key, canonical(2))  # A's genuine entry first
        assert a.flush()
        forge()
        before = raw.get(name)
        assert a.get([key]) == [None], what
        assert raw.get(name) == before, f"{what}: a forged entry is not A's to delete"
    assert a.stats()["redis.unverified"] == len(forgeries)  # counted, for the operator
    (got,) = a.get([other])  # A's untouched entry still loads
    assert got is not None and same_tensors(got.tensors, canonical(3).tensors)


def test_signer_binds_key_and_bytes():
    signer = Signer(b"k" * 16)
    signed = signer.sign("okv2:x", b"entry")
    assert bytes(signer.open("okv2:x", signed)) == b"entry"
    assert signer.open("okv2:y", signed) is None
    assert signer.open("okv2:x", signed[:-1] + bytes([signed[-1] ^ 1])) is None
    assert Signer(b"j" * 16).open("okv2:x", signed) is None
    with pytest.raises(ValueError, match="16 bytes"):
        Signer(b"short")


def test_a_bad_signing_key_file_fails_at_start_up(tmp_path):
    with pytest.raises(ValueError, match="entry_signing_key_file"):
        OrbitKVConfig(entry_signing_key_file=str(tmp_path / "missing"))
    short = _key_file(tmp_path, "short", b"tiny")
    with pytest.raises(ValueError, match="entry_signing_key_file"):
        OrbitKVConfig(entry_signing_key_file=str(short))
    with pytest.raises(ValueError, match="tenant"):
        OrbitKVConfig(tenant="a*")
