"""Values of OrbitKV's config keys, parsed and checked: ``remote_url`` (``RemoteSpec``), booleans,
numbers, token lists and names. Each raises ``ValueError`` naming the key (``config.py`` is the one
reader of config files and env vars; this module only turns their values into Python values)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

# scheme -> (is_cluster, is_tls). LMCache writes a cluster as "redis-cluster://h:p,h:p"; the store
# speaks redis-py URLs plus "redis+cluster://" / "rediss+cluster://" with one seed node (redis-py
# discovers the others), so a cluster URL is rewritten to that on load, seeded by its first node.
_SCHEMES = {"redis": (False, False), "rediss": (False, True), "unix": (False, False),
            "redis+cluster": (True, False), "rediss+cluster": (True, True),
            "redis-cluster": (True, False)}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# redis-py also takes the password as a query argument (``unix:///sock?password=...``).
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


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
        scheme, sep, rest = self.url.partition("://")
        # ``url`` is normalized: any user info is percent-encoded and ends the authority.
        return scheme + sep + _hide_password(rest, rest.rfind("@", 0, _authority_end(rest)))


def _authority_end(rest: str) -> int:
    """Where the authority (``user:password@host:port``) of a URL's part after ``://`` ends: at
    the first ``/``, ``?`` or ``#`` (RFC 3986), so a user info holding one must percent-encode it."""
    return min([i for i in map(rest.find, "/?#") if i >= 0], default=len(rest))


def _hide_password(rest: str, at: int) -> str:
    """``rest`` (a URL after ``://``) with the password of the user info ending at ``at`` (-1:
    none) as ``***``; a user info without ``:`` (``redis://secret@host``) is hidden whole."""
    if at >= 0:
        user, has_pw, _ = rest[:at].partition(":")
        rest = (f"{user}:***" if has_pw else "***") + rest[at:]
    return _QUERY_PASSWORD.sub(r"\1***", rest)


def _hide_user_info(text: str) -> str:
    """``text``, which may not parse, with anything that could be a password as ``***``: up to the
    host's ``@``, or, with an ``@`` past the host, everything up to the last ``@`` (a password that
    did not percent-encode a ``/``, ``?`` or ``#``, which may hold an ``@`` before that too)."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    end = _authority_end(rest)
    at = rest.rfind("@") if "@" in rest[end:] else rest.rfind("@", 0, end)
    return scheme + sep + _hide_password(rest, at)


def redact_url(text: str) -> str:
    """A ``remote_url`` with its password as ``***``, safe to print even when it does not parse."""
    try:
        return parse_remote_url(text).redacted_url
    except ValueError:
        return _hide_user_info(text)


def parse_remote_url(url: str) -> RemoteSpec:
    """Parse and check ``remote_url``; a ``ValueError`` names the key on any problem and never
    carries the password.

    A user name or password may hold any character, percent-encoded where the URL syntax needs it
    (``/`` as ``%2F``, ``?`` as ``%3F``, ``#`` as ``%23``, ``%`` as ``%25``); ``url`` holds them
    percent-encoded, as redis-py reads them."""
    scheme, sep, rest = url.partition("://")
    end = _authority_end(rest)
    # An "@" past the host: a query value, or a user info that did not percent-encode "/", "?"
    # or "#" (with an "@" before it too, if the password holds one). Any error then says so, and
    # shows nothing before the last "@".
    is_suspect = "@" in rest[end:]
    try:
        if is_suspect:  # no Redis URL option takes an "@"
            raise ValueError("an '@' past the host")
        return _parse_remote_url(url, _hide_user_info(url))
    except ValueError:
        if not is_suspect:
            raise
        raise ValueError(
            f"remote_url: malformed URL {_hide_user_info(url)!r}: a user name or password must "
            "percent-encode '/' (%2F), '?' (%3F), '#' (%23) and '%' (%25)"
        ) from None


def _parse_remote_url(url: str, shown: str) -> RemoteSpec:
    """``parse_remote_url`` for ``url``, shown as ``shown`` in errors."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in _SCHEMES:
        allowed = ", ".join(f"{s}://" for s in _SCHEMES)
        raise ValueError(f"remote_url: unsupported URL {shown!r}; expected one of {allowed}")
    is_cluster, is_tls = _SCHEMES[scheme]
    rest, _, query = rest.partition("?")
    is_cluster |= any(v.lower() in _TRUE for v in parse_qs(query).get("cluster", []))
    if scheme == "unix":
        if is_cluster or not rest.startswith("/"):
            raise ValueError(f"remote_url: expected unix:///absolute/socket, got {shown!r}")
        return RemoteSpec(url, False, False, ())
    auth, has_auth, hosts = rest.rpartition("@")
    user, has_pw, pw = auth.partition(":")
    username, password = unquote(user) or None, unquote(pw) if has_pw else None
    if has_auth:  # one spelling for redis-py, which splits the user info at its first ":"
        auth = quote(username or "", safe="") + (f":{quote(password, safe='')}" if has_pw else "")
    hosts, _, path = hosts.partition("/")
    nodes = []
    for host_port in hosts.split(","):
        try:
            parts = urlsplit(f"//{host_port}")
            host, port = parts.hostname, parts.port or 6379
        except ValueError:
            raise ValueError(f"remote_url: bad host:port {host_port!r} in {shown!r}") from None
        if not host:
            raise ValueError(f"remote_url: missing host in {shown!r}")
        nodes.append((host, port))
    if len(nodes) > 1 and not is_cluster:
        raise ValueError(f"remote_url: {scheme}:// takes one host; a cluster is redis+cluster://")
    if path and (is_cluster or not path.isdigit()):
        raise ValueError(f"remote_url: bad database {path!r} in {shown!r}")
    at = f"{auth}@" if has_auth else ""
    tail = f"?{query}" if query else ""
    if is_cluster and (scheme == "redis-cluster" or len(nodes) > 1):
        host, port = nodes[0]
        return RemoteSpec(f"{'rediss' if is_tls else 'redis'}+cluster://{at}{host}:{port}{tail}",
                          is_cluster, is_tls, tuple(nodes), username, password)
    url = f"{url.partition('://')[0]}://{at}{hosts}" + (f"/{path}" if path else "") + tail
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
