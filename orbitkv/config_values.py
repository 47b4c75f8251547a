"""Values of OrbitKV's config keys, parsed and checked: ``remote_url`` (``RemoteSpec``), booleans,
numbers, token lists and names. Each raises ``ValueError`` naming the key (``config.py`` is the one
reader of config files and env vars; this module only turns their values into Python values)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

# scheme -> (is_cluster, is_tls). LMCache writes a cluster as "redis-cluster://h:p,h:p"; the store
# speaks redis-py URLs plus "redis+cluster://" / "rediss+cluster://" with one seed node (redis-py
# discovers the others), so a cluster URL is rewritten to that on load, seeded by its first node.
_SCHEMES = {"redis": (False, False), "rediss": (False, True), "unix": (False, False),
            "redis+cluster": (True, False), "rediss+cluster": (True, True),
            "redis-cluster": (True, False)}  # fmt: skip
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class RemoteSpec:
    """A parsed ``remote_url``. ``url`` is the normalized form the store connects to."""

    url: str
    is_cluster: bool
    is_tls: bool
    nodes: tuple[tuple[str, int], ...]  # every host written, seeds first; empty for unix://
    username: str | None = None
    password: str | None = None
    db: int = 0

    @property
    def redacted_url(self) -> str:
        """The URL without its password, safe to log and to print in ``orbitkv store stats``."""
        return re.sub(r"(://[^/@]*?:)[^/@]*@", r"\1***@", self.url, count=1)


def parse_remote_url(url: str) -> RemoteSpec:
    """Parse and check ``remote_url``; a ``ValueError`` names the key on any problem."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in _SCHEMES:
        allowed = ", ".join(f"{s}://" for s in _SCHEMES)
        raise ValueError(f"remote_url: unsupported URL {url!r}; expected one of {allowed}")
    is_cluster, is_tls = _SCHEMES[scheme]
    rest, _, query = rest.partition("?")
    is_cluster |= any(v.lower() in _TRUE for v in parse_qs(query).get("cluster", []))
    if scheme == "unix":
        if is_cluster or not rest.startswith("/"):
            raise ValueError(f"remote_url: expected unix:///absolute/socket, got {url!r}")
        return RemoteSpec(url, False, False, ())
    auth, _, hosts = rest.rpartition("@")
    user, has_pw, pw = auth.partition(":")
    username, password = unquote(user) or None, unquote(pw) if has_pw else None
    hosts, _, path = hosts.partition("/")
    nodes = []
    for host_port in hosts.split(","):
        try:
            parts = urlsplit(f"//{host_port}")
            host, port = parts.hostname, parts.port or 6379
        except ValueError as exc:
            raise ValueError(f"remote_url: bad host:port {host_port!r} in {url!r}") from exc
        if not host:
            raise ValueError(f"remote_url: missing host in {url!r}")
        nodes.append((host, port))
    if len(nodes) > 1 and not is_cluster:
        raise ValueError(f"remote_url: {scheme}:// takes one host; a cluster is redis+cluster://")
    if path and (is_cluster or not path.isdigit()):
        raise ValueError(f"remote_url: bad database {path!r} in {url!r}")
    if is_cluster and (scheme == "redis-cluster" or len(nodes) > 1):
        at, (host, port) = f"{auth}@" if auth else "", nodes[0]
        url = f"{'rediss' if is_tls else 'redis'}+cluster://{at}{host}:{port}" + (f"?{query}" if query else "")
    return RemoteSpec(url, is_cluster, is_tls, tuple(nodes), username, password, int(path or 0))


def parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = value.strip().lower() if isinstance(value, str) else None
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{key}: expected a boolean, got {value!r}")


def parse_number(key: str, value: Any, kind: type) -> int | float:
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected {kind.__name__}, got {value!r}")
    try:
        number = kind(value.strip()) if isinstance(value, str) else kind(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{key}: expected {kind.__name__}, got {value!r}") from exc
    if kind is int and isinstance(value, float) and value != number:
        raise ValueError(f"{key}: expected int, got {value!r}")
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    return number


def parse_tokens(key: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, str):
        value = value.replace(",", " ").split()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key}: expected a list of token ids, got {value!r}")
    tokens = tuple(int(parse_number(key, v, int)) for v in value)
    if any(t < 0 for t in tokens):
        raise ValueError(f"{key}: token ids must be >= 0, got {value!r}")
    return tokens


def parse_names(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.replace(",", " ").split()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{key}: expected a list of names, got {value!r}")
    return tuple(sorted({v.strip().lower() for v in value}))


def parse_strings(key: str, value: Any) -> tuple[str, ...]:
    """Names as written (case kept), e.g. tenants."""
    if isinstance(value, str):
        value = value.replace(",", " ").split()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"{key}: expected a list of names, got {value!r}")
    return tuple(sorted({v.strip() for v in value}))
