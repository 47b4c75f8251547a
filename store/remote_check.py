"""Start-up check of the Redis tier: wrong credentials or TLS settings are configuration errors.

The Redis tier never fails a request: while Redis is down every read is a miss (``redis_backend``).
That is right for a server that is down, restarting or full, and wrong for a password or a
certificate that can never work: such a replica would serve for ever without its shared tier, and
the only sign would be a store-error counter. So at start-up (``orbitkv serve``, and the connector
when its process builds the store) one handshake decides:

- authentication refused (``WRONGPASS``, ``NOAUTH``, a user without access) -> ``ValueError``
  naming ``remote_url``;
- TLS handshake refused (certificate verification), or a plain (non-TLS) Redis behind
  ``rediss://`` (its handshake only times out: a plain-text ``PING`` then tells it from a server
  that is down) -> ``ValueError`` naming ``remote_url``;
- unreachable (refused, timed out, name not resolved yet) -> a warning; the tier starts as a miss
  and reconnects by itself.

No message carries the password: the URL is redacted and redis-py's errors do not repeat it.
"""

from __future__ import annotations

import logging
import socket
import ssl

import redis
from redis.exceptions import AuthenticationError, RedisClusterException, ResponseError

from orbitkv.config_values import parse_remote_url, redact_url

from .redis_backend import RedisBackend

logger = logging.getLogger(__name__)

OK = "ok"
UNREACHABLE = "unreachable"
_AUTH_WORDS = ("WRONGPASS", "NOAUTH", "NOPERM", "invalid username-password", "Authentication required",
               "AUTH <password> called without any password")
_TLS_WORDS = ("SSL", "CERTIFICATE", "certificate", "TLS", "tlsv1", "wrong version number")


def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def classify(exc: BaseException) -> str:
    """``auth``, ``tls`` or ``unreachable`` for an exception raised by a Redis handshake."""
    chain = _chain(exc)
    text = " ".join(str(e) for e in chain)
    if any(isinstance(e, AuthenticationError) for e in chain) or any(w in text for w in _AUTH_WORDS):
        return "auth"
    if any(isinstance(e, ssl.SSLError) for e in chain) or any(w in text for w in _TLS_WORDS):
        return "tls"
    if any(isinstance(e, ResponseError) for e in chain):
        return "auth"  # a server that answers but refuses the handshake (HELLO/AUTH/SELECT)
    return UNREACHABLE


def check_remote(url: str, *, timeout_s: float = 2.0, key: str = "remote_url") -> str:
    """One handshake with the Redis (or Redis Cluster) of ``url``: ``OK``, ``UNREACHABLE``, or a
    ``ValueError`` naming ``key`` when the credentials or TLS settings are refused."""
    backend = RedisBackend(url, socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
    try:
        backend._get_client().ping()
    except (redis.RedisError, RedisClusterException, OSError) as exc:
        kind = classify(exc)
        where = redact_url(url)
        if kind == UNREACHABLE and _speaks_plain_redis(url, timeout_s):
            raise ValueError(
                f"{key}: {where} asks for TLS, and the server there answers plain Redis (no TLS); "
                "use redis://, or point rediss:// at the server's --tls-port"
            ) from None
        if kind == "auth":
            raise ValueError(
                f"{key}: the Redis at {where} refused the credentials ({_first_line(exc)}); "
                "check the password (and user) in the URL"
            ) from None
        if kind == "tls":
            raise ValueError(
                f"{key}: the TLS handshake with {where} failed ({_first_line(exc)}); check "
                "rediss:// versus redis://, and ssl_ca_certs / ssl_certfile / ssl_keyfile in the URL"
            ) from None
        logger.warning("OrbitKV: %s %s is unreachable at start-up (%s); its reads are misses "
                       "until it answers", key, where, _first_line(exc))
        return UNREACHABLE
    finally:
        backend.close()
    return OK


def check_config(config: object) -> str | None:
    """``check_remote`` for an ``OrbitKVConfig`` with a ``remote_url`` (None without one); also
    the settings ``lmcache_interop`` needs."""
    check_interop_config(config)
    url = getattr(config, "remote_url", None)
    if not url:
        return None
    timeout_s = float(getattr(config, "remote_connect_timeout_s", 0.5)) + float(
        getattr(config, "remote_timeout_s", 1.0))
    return check_remote(url, timeout_s=timeout_s)


def check_interop_config(config: object) -> None:
    """``lmcache_interop`` needs LMCache's Redis and its raw serde; fail at start-up, naming keys."""
    if not getattr(config, "lmcache_interop", False):
        return
    url = getattr(config, "remote_url", None)
    if not url:
        raise ValueError("lmcache_interop: needs remote_url (the Redis the LMCache nodes use)")
    serde = getattr(config, "remote_serde", None)
    if serde not in (None, "naive"):
        raise ValueError(f"lmcache_interop: remote_serde must be 'naive', got {serde!r}")
    if url.split("://", 1)[0].endswith("cluster"):
        # LMCache 0.5.6's RedisConnector speaks to one server; its cluster connector keys differ.
        raise ValueError("lmcache_interop: remote_url must be one Redis server (redis:// or rediss://)")


def _speaks_plain_redis(url: str, timeout_s: float) -> bool:
    """Whether ``url`` asks for TLS and its (first) server answers a plain-text ``PING``.

    A plain Redis reads a TLS ClientHello as an unfinished command and waits, so the TLS handshake
    only times out, as with a server that is down; a RESP reply to a plain PING tells them apart
    (a TLS port answers it with an alert or by closing)."""
    spec = parse_remote_url(url)
    if not spec.is_tls or not spec.nodes:
        return False
    try:
        with socket.create_connection(spec.nodes[0], timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    return reply.startswith((b"+PONG", b"-NOAUTH", b"-ERR", b"-WRONGPASS"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]
